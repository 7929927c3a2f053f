"""Load HunyuanVideo-1.5 from a local directory in either layout, into diffusers' HunyuanVideo15Pipeline.

Diffusers layout (primary; e.g. hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v):
    model_index.json, transformer/, vae/, text_encoder/, tokenizer/, text_encoder_2/, tokenizer_2/, scheduler/
    (+ image_encoder/, feature_extractor/ for image-to-video: SigLIP, listed in model_index.json)
Authors' layout (`hf download tencent/HunyuanVideo-1.5` into --pretrained_model_root):
    transformer/<version>/*.safetensors   (authors' keys; converted with sage_grpo.models.convert)
    vae/config.json + *.safetensors       (authors' keys)
    text_encoder/llm/                     (Qwen2.5-VL-7B-Instruct; its text tower is used)
    text_encoder/byt5-small/              (config + tokenizer of google/byt5-small)
    text_encoder/Glyph-SDXL-v2/           (checkpoints/byt5_model.pt + assets/*.json: the glyph ByT5 weights)
    vision_encoder/siglip/{image_encoder,feature_extractor}/   (image-to-video only: FLUX.1-Redux-dev's SigLIP)

The task is the checkpoint's: image-to-video (I2V) when the diffusers model_index.json lists an image_encoder, or
the authors' version name holds "i2v" (480p_i2v, ...). The transformer config's task_type is not used: forward never
reads it, and diffusers' converter writes "i2v" into its 480p_t2v config. An I2V checkpoint loads into
HunyuanVideo15ImageToVideoPipeline (the same text handling plus SigLIP and the image bucketing), a T2V one into
HunyuanVideo15Pipeline.

The pipeline object is only a container here: the rollout loop (sage_grpo.rollout) drives the transformer itself
and calls `encode_prompt`; keeping diffusers' class means its text handling (chat template, crop, glyph
extraction) is used as is. Nothing is downloaded: a missing piece raises SageGRPOError naming it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from sage_grpo.config import DTYPES
from sage_grpo.config import torch_dtype as resolve_dtype
from sage_grpo.errors import SageGRPOError
from sage_grpo.models.tiny import TEXT_LENGTHS_FILE, TextLengths

__all__ = [
    "DTYPES",
    "ModelLocation",
    "resolve_dtype",
    "locate_model",
    "missing_pieces",
    "load_pipeline",
    "apply_text_lengths",
    "freeze",
    "checkpoint_task",
    "checkpoint_sampling_defaults",
    "read_transformer_config",
    "transformer_config",
    "meta_transformer",
    "load_transformer",
    "attach_transformer",
    "read_text_encoders",
    "transformer_row_reader",
]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_DOWNLOAD_HINT = (
    "Download the weights with ./download_weights.sh (see docs/real_weights.md), or build a tiny random model for a "
    "CPU smoke test with: python scripts/make_tiny_checkpoint.py --out outputs/tiny_ckpts/hunyuanvideo15"
)


@dataclass(frozen=True)
class ModelLocation:
    """Where the weights are and in which layout."""

    root: Path
    layout: str  # "diffusers" | "authors"
    version: str  # e.g. "480p_t2v" (the authors' transformer sub-folder)

    @property
    def task(self) -> str:
        return checkpoint_task(self)


def checkpoint_task(loc: ModelLocation) -> str:
    """"i2v" or "t2v" from the checkpoint's files (no weights read): the diffusers model_index.json lists an
    image_encoder (only the I2V repositories have one), or the authors' version name says i2v."""
    from sage_grpo.models.tiny import task_of_version

    if loc.layout == "diffusers":
        try:
            index = json.loads((loc.root / "model_index.json").read_text())
        except (OSError, ValueError) as e:
            raise SageGRPOError(f"{loc.root / 'model_index.json'} cannot be read: {e}") from None
        entry = index.get("image_encoder")
        return "i2v" if isinstance(entry, list) and entry and entry[0] is not None else "t2v"
    return task_of_version(loc.version)


def _has_weights(d: Path) -> bool:
    return d.is_dir() and any(f.name.endswith(_WEIGHT_SUFFIXES) for f in d.iterdir())


def _has_tokenizer(d: Path) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "special_tokens_map.json")
    return d.is_dir() and any((d / n).exists() for n in names)


def _image_encoder_checks(r: Path, encoder: str, processor: str) -> list[tuple[str, bool]]:
    """The SigLIP image encoder of an I2V checkpoint (FLUX.1-Redux-dev's, see download_weights.sh)."""
    return [(f"{encoder}/ (SigLIP config.json + weights)", (r / encoder / "config.json").is_file()
             and _has_weights(r / encoder)),
            (f"{processor}/preprocessor_config.json", (r / processor / "preprocessor_config.json").is_file())]


def missing_pieces(loc: ModelLocation) -> list[str]:
    """Paths (relative to the root) that a complete checkpoint of `loc.layout` needs and that are absent."""
    r = loc.root
    checks: list[tuple[str, bool]]
    if loc.layout == "diffusers":
        checks = [("model_index.json", (r / "model_index.json").is_file())]
        for sub in ("transformer", "vae", "text_encoder", "text_encoder_2"):
            checks.append((f"{sub}/ (config.json + "
                           "weights)", (r / sub / "config.json").is_file() and _has_weights(r / sub)))
        for sub in ("tokenizer", "tokenizer_2"):
            checks.append((f"{sub}/", _has_tokenizer(r / sub)))
        if checkpoint_task(loc) == "i2v":
            checks += _image_encoder_checks(r, "image_encoder", "feature_extractor")
    else:
        t = r / "transformer" / loc.version
        glyph = r / "text_encoder" / "Glyph-SDXL-v2"
        checks = [
            (f"transformer/{loc.version}/ (weights)", _has_weights(t)),
            ("vae/ (config.json + weights)", (r / "vae" / "config.json").is_file() and _has_weights(r / "vae")),
            ("text_encoder/llm/ (config.json + "
             "weights)", (r / "text_encoder/llm/config.json").is_file() and _has_weights(r / "text_encoder/llm")),
            ("text_encoder/llm/ (tokenizer)", _has_tokenizer(r / "text_encoder/llm")),
            ("text_encoder/byt5-small/config.json", (r / "text_encoder/byt5-small/config.json").is_file()),
            ("text_encoder/Glyph-SDXL-v2/checkpoints/byt5_model.pt", (glyph / "checkpoints/byt5_model.pt").is_file()),
            ("text_encoder/Glyph-SDXL-v2/assets/color_idx.json", (glyph / "assets/color_idx.json").is_file()),
            ("text_encoder/Glyph-SDXL-v2/assets/multilingual_10-lang_idx.json",
             (glyph / "assets/multilingual_10-lang_idx.json").is_file()),
        ]
        if checkpoint_task(loc) == "i2v":
            from sage_grpo.models.authors_layout import SIGLIP_DIR

            checks += _image_encoder_checks(r, f"{SIGLIP_DIR}/image_encoder", f"{SIGLIP_DIR}/feature_extractor")
    return [name for name, ok in checks if not ok]


def locate_model(
    pretrained_model_root: str = "ckpts", model_path: str = "", version: str = "480p_t2v"
) -> ModelLocation:
    """Find the checkpoint and its layout.

    `model_path` (if set) must be a diffusers-layout directory or an authors' root. Otherwise, under
    `pretrained_model_root`: a diffusers layout at the root, then `HunyuanVideo-1.5-Diffusers-<version>/` (where
    download_weights.sh puts it), then the authors' layout (`transformer/<version>`). Fails listing what is
    missing from the most likely candidate.
    """
    from sage_grpo.models.tiny import variant_of

    candidates: list[Path] = []
    if not model_path:
        variant_of(version)  # the version names the folder: an unknown or unsupported one is one error here
    if model_path:
        candidates.append(Path(model_path))
    else:
        root = Path(pretrained_model_root)
        candidates += [root, root / f"HunyuanVideo-1.5-Diffusers-{version}"]
    for c in candidates:
        if (c / "model_index.json").is_file():
            loc = ModelLocation(c, "diffusers", version)
            break
        if (c / "transformer" / version).is_dir() or (c / "text_encoder" / "llm").is_dir():
            loc = ModelLocation(c, "authors", version)
            break
    else:
        where = model_path or pretrained_model_root
        raise SageGRPOError(
            f"no HunyuanVideo-1.5 checkpoint found at {where!r}: expected a diffusers layout (model_index.json, "
            f"transformer/, vae/, text_encoder/, tokenizer/, text_encoder_2/, tokenizer_2/) or the authors' layout "
            f"(transformer/{version}/, vae/, text_encoder/llm/, text_encoder/byt5-small/, "
            f"text_encoder/Glyph-SDXL-v2/). {_DOWNLOAD_HINT}"
        )
    if loc.layout == "authors":
        variant_of(version)  # the authors' transformer/<version>: a known, supported name
    missing = missing_pieces(loc)
    if missing:
        raise SageGRPOError(
            f"incomplete HunyuanVideo-1.5 checkpoint ({loc.layout} layout) at {str(loc.root)!r}; missing:\n  - "
            + "\n  - ".join(missing)
            + f"\n{_DOWNLOAD_HINT}"
        )
    return loc


def read_text_lengths(root: Path) -> TextLengths:
    """Real defaults, or the overrides a tiny checkpoint stores next to its weights."""
    f = Path(root) / TEXT_LENGTHS_FILE
    if f.is_file():
        return TextLengths(**json.loads(f.read_text()))
    return TextLengths()


def apply_text_lengths(pipe, lengths: TextLengths) -> None:
    """Set the pipeline's plain text-length attributes (save_pretrained does not store them)."""
    for name, value in lengths.to_dict().items():
        setattr(pipe, name, value)


def freeze(*modules: torch.nn.Module | None) -> None:
    """requires_grad_(False) and eval() on frozen parts (text encoders, VAE, reference copies)."""
    for m in modules:
        if m is not None:
            m.requires_grad_(False).eval()


def load_pipeline(
    pretrained_model_root: str = "ckpts",
    model_path: str = "",
    version: str = "480p_t2v",
    *,
    dtype: str | torch.dtype = "bf16",
    transformer_dtype: str | torch.dtype | None = None,
    vae_dtype: str | torch.dtype | None = None,
    load_text_encoders: bool = True,
    device: str | torch.device = "cpu",
    transformer: torch.nn.Module | None = None,
    load_image_encoder: bool = True,
    load_transformer: bool = True,
):
    """-> diffusers.HunyuanVideo15Pipeline (T2V checkpoint) or HunyuanVideo15ImageToVideoPipeline (I2V) with every
    part frozen except the transformer (trainable, train mode off); `pipe.sage_grpo_task` is "t2v" or "i2v".

    dtype: frozen parts (text encoders; the VAE unless vae_dtype). transformer_dtype: the policy weights (e.g. fp32
    master weights with bf16 autocast; default = dtype). load_text_encoders=False leaves them None (prompt
    embeddings all cached on disk). transformer: an already built transformer (FSDP2: the sharded one from
    sage_grpo.models.parallelize.load_sharded_transformer) used instead of loading the whole one; it is not moved.
    load_image_encoder=False leaves an I2V checkpoint's SigLIP None (every reference image already encoded).
    load_transformer=False puts a meta-device stand-in built from the checkpoint's config in its place (no memory:
    its config answers the conditioning code; `attach_transformer` replaces it): post_train encodes every prompt
    and image, frees the encoders and only then loads the policy, so the 7B text encoder and the 8.3B transformer
    never sit in memory together.
    """
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

    loc = locate_model(pretrained_model_root, model_path, version)
    dt = resolve_dtype(dtype)
    tdt = resolve_dtype(transformer_dtype) if transformer_dtype is not None else dt
    vdt = resolve_dtype(vae_dtype) if vae_dtype is not None else dt
    if transformer is not None and loc.layout != "diffusers":
        raise SageGRPOError("sharded (FSDP2) loading reads the diffusers layout; convert the authors' transformer "
                            "with sage_grpo.models.convert, or use --model_path of a diffusers-layout checkpoint")
    loads = transformer is None and load_transformer
    if loc.layout == "diffusers":
        parts = _load_diffusers_parts(loc.root, tdt, vdt, dt, load_text_encoders, with_transformer=loads)
    else:
        from sage_grpo.models.authors_layout import load_authors_parts

        parts = load_authors_parts(loc.root, loc.version, tdt, vdt, dt, load_text_encoders, load_transformer=loads)
    if transformer is None and not load_transformer:
        transformer = meta_transformer(loc)
    from sage_grpo.models.attention import use_valid_token_attention

    task = loc.task
    if task == "i2v":
        parts.update(_load_image_encoder(loc, dt, load_image_encoder))
    if transformer is not None:
        parts["transformer"] = transformer
    use_valid_token_attention(parts["transformer"])  # attention over valid tokens only (no dense [B,1,S,S] mask)
    scheduler, guider = _sampling_defaults(loc)
    cls = HunyuanVideo15ImageToVideoPipeline if task == "i2v" else HunyuanVideo15Pipeline
    pipe = cls(scheduler=scheduler, guider=guider, **parts)
    apply_text_lengths(pipe, read_text_lengths(loc.root))
    image_encoder = getattr(pipe, "image_encoder", None)
    freeze(pipe.vae, pipe.text_encoder, pipe.text_encoder_2, image_encoder)
    pipe.transformer.eval()
    for part in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, image_encoder):
        if part is not None:
            part.to(device)
    if loads:
        pipe.transformer.to(device)  # a sharded transformer already sits where its shards belong (device or offload)
    pipe.sage_grpo_location = loc  # for provenance (generate.py's config dump, the text cache identity)
    pipe.sage_grpo_task = task
    return pipe


def transformer_config(loc: ModelLocation) -> dict:
    """HunyuanVideo15Transformer3DModel kwargs of the checkpoint, read from its files without loading weights."""
    if loc.layout == "diffusers":
        return read_transformer_config(loc.root / "transformer")
    from sage_grpo.models.authors_layout import authors_transformer_config

    return authors_transformer_config(loc.root / "transformer" / loc.version, loc.version)


def meta_transformer(loc: ModelLocation) -> torch.nn.Module:
    """The checkpoint's transformer on the meta device: its config and shapes, no memory."""
    from diffusers import HunyuanVideo15Transformer3DModel

    with torch.device("meta"):
        return HunyuanVideo15Transformer3DModel.from_config(transformer_config(loc))


def load_transformer(loc: ModelLocation, dtype: torch.dtype) -> torch.nn.Module:
    """The whole transformer of the checkpoint in `dtype` (either layout), on the CPU."""
    if loc.layout == "diffusers":
        from diffusers import HunyuanVideo15Transformer3DModel

        return HunyuanVideo15Transformer3DModel.from_pretrained(loc.root / "transformer", torch_dtype=dtype)
    from sage_grpo.models.authors_layout import load_authors_transformer

    return load_authors_transformer(loc.root / "transformer" / loc.version, loc.version, dtype)


def read_text_encoders(loc: ModelLocation, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(MLLM text encoder, ByT5 glyph encoder) of the checkpoint, frozen, on the CPU (either layout)."""
    if loc.layout == "diffusers":
        from transformers import Qwen2_5_VLTextModel, T5EncoderModel

        encoders = (Qwen2_5_VLTextModel.from_pretrained(os.fspath(loc.root / "text_encoder"), dtype=dtype),
                    T5EncoderModel.from_pretrained(os.fspath(loc.root / "text_encoder_2"), dtype=dtype))
    else:
        from sage_grpo.models.authors_layout import load_authors_text_encoders

        encoders = load_authors_text_encoders(loc.root, dtype)
    freeze(*encoders)
    return encoders


def attach_transformer(pipe, transformer: torch.nn.Module) -> None:
    """Put the policy `transformer` into `pipe` (in place of load_pipeline's meta stand-in), with the valid-token
    attention load_pipeline gives every transformer it holds."""
    from sage_grpo.models.attention import use_valid_token_attention

    use_valid_token_attention(transformer)
    pipe.register_modules(transformer=transformer.eval())


def _sampling_defaults(loc: ModelLocation):
    """The checkpoint's scheduler (flow shift) and guider (CFG scale) from its own scheduler/ and guider/ configs; a
    layout without them (the authors') gets its version's (sage_grpo.models.tiny.VARIANTS: shift 5 / 9 / 7, CFG 6,
    or 1 for the distilled models)."""
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler

    from sage_grpo.models.tiny import VARIANTS

    default = VARIANTS.get(loc.version, VARIANTS["480p_t2v"])  # a diffusers path's version is only a folder name
    sched_dir, guider_dir = loc.root / "scheduler", loc.root / "guider"
    if (sched_dir / "scheduler_config.json").is_file():
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(sched_dir)
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=default.flow_shift)
    if (guider_dir / "guider_config.json").is_file():
        guider = ClassifierFreeGuidance.from_pretrained(guider_dir)
    else:
        guider = ClassifierFreeGuidance(guidance_scale=default.guidance_scale)
    return scheduler, guider


def checkpoint_sampling_defaults(loc: ModelLocation) -> dict[str, float]:
    """{"flow_shift", "guidance_scale"} of the checkpoint (its scheduler / guider configs, or its version's defaults;
    no weights read)."""
    scheduler, guider = _sampling_defaults(loc)
    return {"flow_shift": float(scheduler.config.shift), "guidance_scale": float(guider.guidance_scale)}


def _load_image_encoder(loc: ModelLocation, dt: torch.dtype, load: bool) -> dict:
    """SigLIP of an I2V checkpoint -> {image_encoder, feature_extractor} (the encoder None when not `load`)."""
    from transformers import SiglipImageProcessor, SiglipVisionModel

    if loc.layout == "diffusers":
        enc, proc = loc.root / "image_encoder", loc.root / "feature_extractor"
    else:
        from sage_grpo.models.authors_layout import SIGLIP_DIR

        enc, proc = loc.root / SIGLIP_DIR / "image_encoder", loc.root / SIGLIP_DIR / "feature_extractor"
    return dict(
        image_encoder=SiglipVisionModel.from_pretrained(os.fspath(enc), dtype=dt) if load else None,
        feature_extractor=SiglipImageProcessor.from_pretrained(os.fspath(proc)),
    )


def _load_diffusers_parts(root: Path, tdt, vdt, dt, load_text_encoders: bool, with_transformer: bool = True) -> dict:
    from diffusers import AutoencoderKLHunyuanVideo15
    from transformers import AutoTokenizer, ByT5Tokenizer

    loc = ModelLocation(root, "diffusers", "")
    parts = dict(
        transformer=load_transformer(loc, tdt) if with_transformer else None,
        vae=AutoencoderKLHunyuanVideo15.from_pretrained(root / "vae", torch_dtype=vdt),
        tokenizer=AutoTokenizer.from_pretrained(os.fspath(root / "tokenizer")),
        tokenizer_2=ByT5Tokenizer.from_pretrained(os.fspath(root / "tokenizer_2")),
        text_encoder=None,
        text_encoder_2=None,
    )
    if load_text_encoders:
        parts["text_encoder"], parts["text_encoder_2"] = read_text_encoders(loc, dt)
    return parts


# ------------------------------------------------------------------------------------------------ sharded loading
# FSDP2 (sage_grpo.models.parallelize.load_sharded_transformer) builds the transformer on the meta device and reads
# only each rank's rows of every tensor, so no rank ever holds the whole model in host memory.

_ST_SINGLE = "diffusion_pytorch_model.safetensors"
_ST_INDEX = "diffusion_pytorch_model.safetensors.index.json"


def read_transformer_config(transformer_dir: str | Path) -> dict:
    """The diffusers config.json of a `transformer/` directory (what from_config takes)."""
    f = Path(transformer_dir) / "config.json"
    if not f.is_file():
        raise SageGRPOError(f"{f} is missing: sharded loading needs a diffusers-layout transformer/ directory")
    return json.loads(f.read_text())


class transformer_row_reader:
    """Context manager -> reader(key, start, stop): rows [start, stop) of one tensor of a diffusers transformer
    directory (one safetensors file, or shards listed in diffusion_pytorch_model.safetensors.index.json).

    Uses `safe_open(...).get_slice(key)[start:stop]`, which reads only those rows from the memory-mapped file: a
    rank's peak is its own rows of one tensor, not the tensor and not the model. 0-d tensors are read whole.
    """

    def __init__(self, transformer_dir: str | Path):
        d = Path(transformer_dir)
        if (d / _ST_INDEX).is_file():
            self.where = {k: d / f for k, f in json.loads((d / _ST_INDEX).read_text())["weight_map"].items()}
        elif (d / _ST_SINGLE).is_file():
            self.where = None
            self.single = d / _ST_SINGLE
        else:
            raise SageGRPOError(f"no {_ST_SINGLE} or {_ST_INDEX} in {d} (sharded loading reads diffusers safetensors)")
        self._open: dict[Path, object] = {}

    def _file(self, key: str):
        from safetensors import safe_open

        path = self.single if self.where is None else self.where.get(key)
        if path is None:
            raise SageGRPOError(f"tensor {key!r} is not in the checkpoint index")
        if path not in self._open:
            f = safe_open(str(path), framework="pt", device="cpu")
            self._open[path] = (f, set(f.keys()))  # keys() builds a new list per call: once per file
        return self._open[path]

    def __call__(self, key: str, start: int, stop: int) -> torch.Tensor:
        f, keys = self._file(key)
        if key not in keys:
            raise SageGRPOError(f"tensor {key!r} is missing from the checkpoint")
        sl = f.get_slice(key)
        if len(sl.get_shape()) == 0:
            return sl[...]
        return sl[start:stop]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._open.clear()
        return False
