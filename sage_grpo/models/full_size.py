"""The real HunyuanVideo-1.5 shapes, and a random-weight checkpoint of them written without holding a model in RAM.

`real_configs(version)` is the one place the real component configs live:
- transformer: diffusers' `HunyuanVideo15Transformer3DModel()` defaults are the 480p model (8,326,608,160
  parameters: 54 double-stream blocks of 151,056,896, 16 x 128 heads, text 3584, ByT5 1472, image 1152); a version
  changes only target_size (640 / 960), task_type and use_meanflow (sage_grpo.models.tiny.VARIANTS);
- VAE: `AutoencoderKLHunyuanVideo15()` defaults (1,260,634,115 parameters: latent 32, 16x spatial, 4x temporal);
- MLLM text encoder: the text tower of Qwen2.5-VL-7B-Instruct (28 layers, 3584 wide, 28 / 4 heads, MLP 18944,
  vocabulary 152,064); `text_layers` < 28 keeps its width and vocabulary and cuts its depth (the transformer sees
  the same 3584-wide embeddings: hidden_states[-3] of a shallower tower);
- glyph encoder: google/byt5-small's encoder (12 layers, 1472 wide, 6 heads, gated-GELU MLP 3584);
- image encoder (I2V): SigLIP so400m-patch14-384 (27 layers, 1152 wide, 16 heads, MLP 4304; 729 image tokens).

`write_full_size_checkpoint` writes them in the diffusers layout (model_index.json and one folder per component,
weights as bf16 safetensors shards with the libraries' index files), from models built on the meta device: the
shard plan comes from huggingface_hub's `split_torch_state_dict_into_shards` on the meta tensors (it reads only
sizes) and each shard is filled and written on its own, so the writer's peak memory is one shard (2 GB by default),
never a model. The tokenizers are the tiny model's byte-level Qwen2 tokenizer (the real one is a hub download) and
ByT5's file-free tokenizer; the pipeline's text lengths are the real ones (1000 MLLM tokens after the crop, 256
ByT5, 729 image tokens), with the crop measured on that tokenizer (sage_grpo_text_lengths.json).

Random weights: 2-D and larger tensors N(0, 0.02^2); 1-D tensors named like norms' scales ones, other 1-D tensors
(biases, the modulation's shifts) N(0, 0.02^2) too; each tensor drawn from a generator seeded by (seed, its
name), so a tensor's values do not depend on the shard plan or the order of writing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

__all__ = [
    "REAL_TRANSFORMER_PARAMS",
    "REAL_BLOCK_PARAMS",
    "QWEN_TEXT_LAYERS",
    "real_configs",
    "real_transformer_config",
    "miniature_configs",
    "build_on_meta",
    "write_full_size_checkpoint",
    "write_authors_checkpoint",
    "expected_tensor",
    "checkpoint_bytes",
]

REAL_TRANSFORMER_PARAMS = 8_326_608_160  # diffusers' default config on the meta device (/work/shared gpu_facts)
REAL_BLOCK_PARAMS = 151_056_896
QWEN_TEXT_LAYERS = 28  # Qwen2.5-VL-7B-Instruct's text tower
# Qwen2.5-VL-7B-Instruct's vision tower (its config.json's vision_config, 676M parameters): the authors'
# text_encoder/llm is the whole Qwen2.5-VL checkpoint, of which the pipeline keeps the text tower.
QWEN_VISION_CONFIG = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                          in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                          fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu")

_STD = 0.02
_DEFAULT_SHARD = "2GB"


def real_configs(version: str = "480p_t2v", text_layers: int = QWEN_TEXT_LAYERS) -> dict[str, dict]:
    """{component: config kwargs} of the real checkpoint of `version` (diffusers folder names); `image_encoder` only
    for an I2V version. `text_layers` cuts the Qwen text tower's depth (see the module docstring)."""
    from sage_grpo.models.tiny import variant_of

    v = variant_of(version)
    if not 3 <= text_layers <= QWEN_TEXT_LAYERS:
        raise ValueError(f"text_layers must be in [3, {QWEN_TEXT_LAYERS}] (the pipeline reads hidden_states[-3])")
    configs = {
        # everything else is diffusers' default = the real 480p transformer
        "transformer": dict(target_size=v.target_size, task_type=v.task, use_meanflow=v.use_meanflow),
        "vae": {},  # diffusers' defaults are the real VAE
        "text_encoder": dict(  # Qwen2.5-VL-7B-Instruct text_config
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=text_layers,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
            hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                "mrope_section": [16, 24, 24]},
            bos_token_id=151643, eos_token_id=151645, pad_token_id=151643, tie_word_embeddings=False,
        ),
        "text_encoder_2": dict(  # google/byt5-small (encoder only)
            vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
            relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", is_encoder_decoder=True,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, tie_word_embeddings=False,
        ),
    }
    if v.task == "i2v":
        configs["image_encoder"] = dict(  # google/siglip-so400m-patch14-384 vision tower
            hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
            image_size=384, patch_size=14, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
        )
    return configs


def real_transformer_config(version: str = "480p_t2v") -> dict:
    """The whole HunyuanVideo15Transformer3DModel config of `version` (every key, diffusers' defaults filled in)."""
    cfg = build_on_meta("transformer", real_configs(version)["transformer"]).config
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items() if not k.startswith("_")}


def miniature_configs(version: str = "480p_t2v") -> dict[str, dict]:
    """`real_configs(version)` with every width and depth cut to a CPU-test size (same classes, same keys, same
    writer and loader): what `scripts/real_size_cpu.py --miniature` and the tests write."""
    cfg = real_configs(version, text_layers=3)
    small = {
        "transformer": dict(cfg["transformer"], num_layers=2, num_attention_heads=2, attention_head_dim=32,
                            rope_axes_dim=(4, 14, 14), text_embed_dim=64, text_embed_2_dim=32, image_embed_dim=32,
                            in_channels=9, out_channels=4),
        "vae": dict(latent_channels=4, block_out_channels=(16, 32, 32), layers_per_block=1,
                    spatial_compression_ratio=4),
        "text_encoder": dict(cfg["text_encoder"], hidden_size=64, intermediate_size=64, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=300, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}),
        "text_encoder_2": dict(cfg["text_encoder_2"], d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2),
    }
    if "image_encoder" in cfg:
        small["image_encoder"] = dict(cfg["image_encoder"], hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, image_size=28)
    return small


def build_on_meta(component: str, config: dict) -> torch.nn.Module:
    """The component's model on the meta device (no memory): shapes, names and config only."""
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel
    from transformers import (
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        SiglipVisionConfig,
        SiglipVisionModel,
        T5Config,
        T5EncoderModel,
    )

    with torch.device("meta"):
        if component == "transformer":
            return HunyuanVideo15Transformer3DModel(**config)
        if component == "vae":
            return AutoencoderKLHunyuanVideo15(**config)
        if component == "text_encoder":
            return Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**config))
        if component == "text_encoder_2":
            return T5EncoderModel(T5Config(**config))
        if component == "image_encoder":
            return SiglipVisionModel(SiglipVisionConfig(**config))
    raise ValueError(f"unknown component {component!r}")


def _random_like(name: str, meta: torch.Tensor, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `meta`'s shape in `dtype`, drawn from a generator seeded by (seed, name)."""
    if not meta.is_floating_point():  # integer buffers (none in these models' state dicts; kept exact if any)
        return torch.zeros(meta.shape, dtype=meta.dtype)
    if meta.dim() == 1 and "norm" in name and name.endswith("weight"):
        return torch.ones(meta.shape, dtype=dtype)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.empty(meta.shape, dtype=dtype).normal_(0.0, _STD, generator=g)


def _unique_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The persistent state of `model` with tied tensors once (the first name wins, as save_pretrained keeps it)."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t
    return out


def _write_weights(model: torch.nn.Module, folder: Path, *, diffusers: bool, seed: int, dtype: torch.dtype,
                   max_shard_size: str, prefix: str) -> int:
    """Fill and write `model`'s state shard by shard (one shard in memory at a time) -> bytes written."""
    stem = "diffusion_pytorch_model" if diffusers else "model"
    return _write_state(_unique_state(model), folder, stem, seed=seed, dtype=dtype, max_shard_size=max_shard_size,
                        value_name=lambda n: prefix + n)


def _write_state(state: dict[str, torch.Tensor], folder: Path, stem: str, *, seed: int, dtype: torch.dtype,
                 max_shard_size: str, value_name) -> int:
    """Write {file key: meta tensor} as `stem`*.safetensors shards (and the index when sharded), each tensor drawn
    from the generator of (seed, value_name(key)), one shard in memory at a time -> bytes written."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    state = {n: t.to(dtype) if t.is_floating_point() else t for n, t in state.items()}  # meta casts
    split = split_torch_state_dict_into_shards(state, filename_pattern=stem + "{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    total = 0
    for filename, names in split.filename_to_tensors.items():
        shard = {n: _random_like(value_name(n), state[n], seed, dtype) for n in names}
        save_file(shard, str(folder / filename), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        del shard
    if split.is_sharded:
        index = {"metadata": {"total_size": total}, "weight_map": split.tensor_to_filename}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def write_full_size_checkpoint(out: str | Path, version: str = "480p_t2v", *, seed: int = 0,
                               text_layers: int = QWEN_TEXT_LAYERS, dtype: torch.dtype = torch.bfloat16,
                               max_shard_size: str = _DEFAULT_SHARD, configs: dict[str, dict] | None = None,
                               log=print) -> Path:
    """Write a random-weight checkpoint of the real shapes of `version` under `out` (diffusers layout) -> `out`.

    `configs` replaces `real_configs(version, text_layers)` (the tests write the same code path at a small size).
    The non-weight files (model_index.json, tokenizers, scheduler/, guider/, the SigLIP processor) come from the
    tiny checkpoint of the same version, whose classes are the real ones; every weight folder is then replaced."""
    import time

    from sage_grpo.files import usual_permissions
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    out = Path(out)
    configs = configs if configs is not None else real_configs(version, text_layers)
    write_tiny_checkpoint(out, "diffusers", seed, version)  # the layout and every non-weight file
    for component, config in configs.items():
        t0 = time.perf_counter()
        model = build_on_meta(component, config)
        folder = out / component
        shutil.rmtree(folder)
        folder.mkdir()
        diffusers = component in ("transformer", "vae")
        if diffusers:
            model.save_config(folder)
        else:
            model.config.dtype = dtype  # what save_pretrained records for a bf16 model
            model.config.save_pretrained(folder)
        n = _write_weights(model, folder, diffusers=diffusers, seed=seed, dtype=dtype,
                           max_shard_size=max_shard_size, prefix=f"{component}.")
        params = sum(p.numel() for p in _unique_state(model).values())
        log(f"  {component}: {params:,} parameters, {n / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s")
        del model
    if "image_encoder" in configs:  # the processor of the real encoder's resolution (SigLIP's 0.5 mean/std)
        _write_processor(out / "feature_extractor", configs["image_encoder"])
    _write_text_lengths(out, configs)
    return usual_permissions(out)


def _write_processor(folder: Path, image_config: dict) -> None:
    from transformers import SiglipImageProcessor

    shutil.rmtree(folder, ignore_errors=True)
    size = image_config["image_size"]
    SiglipImageProcessor(size={"height": size, "width": size}).save_pretrained(folder)


def _write_text_lengths(out: Path, configs: dict[str, dict]) -> None:
    """The pipeline's text lengths: the MLLM crop measured on the tokenizer written, the image tokens of SigLIP."""
    from sage_grpo.models.tiny import (
        TEXT_LENGTHS_FILE,
        TextLengths,
        build_tiny_tokenizer,
        default_system_message,
        tiny_crop_start,
    )

    crop = tiny_crop_start(build_tiny_tokenizer(), default_system_message())
    image = configs.get("image_encoder")
    tokens = 729 if image is None else (image["image_size"] // image["patch_size"]) ** 2
    lengths = TextLengths(prompt_template_encode_start_idx=crop, vision_num_semantic_tokens=tokens)
    (out / TEXT_LENGTHS_FILE).write_text(json.dumps(lengths.to_dict(), indent=1) + "\n")


def expected_tensor(component: str, name: str, meta: torch.Tensor, seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The values both writers give tensor `name` (diffusers' name) of `component`: what a loaded or converted
    checkpoint must hold."""
    return _random_like(f"{component}.{name}", meta, seed, dtype)


# safetensors' dtype names of the dtypes written here
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def _groups(names: list[str]) -> list[list[str]]:
    """`names` grouped by module up to the first numbered part ("transformer_blocks.3", "x_embedder"): a group
    holds every tensor a key conversion may fuse (q, k and v of one attention)."""
    groups: dict[str, list[str]] = {}
    for n in names:
        parts = n.split(".")
        cut = next((i + 1 for i, p in enumerate(parts) if p.isdigit()), 1)
        groups.setdefault(".".join(parts[:cut]), []).append(n)
    return list(groups.values())


def _write_converted_file(model: torch.nn.Module, path: Path, convert, component: str, *, seed: int,
                          dtype: torch.dtype) -> int:
    """`model`'s state in another key layout (`convert`: diffusers' names -> those) as ONE safetensors file, as the
    authors ship their transformer, streamed a group at a time -> bytes of tensor data. Ours because safetensors'
    save_file takes the whole state in memory (16.6 GB for the transformer): the header is computed from the
    converted meta tensors, then each group is drawn, converted and appended in the header's order."""
    import struct

    meta = {n: t.to(dtype) if t.is_floating_point() else t for n, t in _unique_state(model).items()}
    plan = [(g, convert({n: meta[n] for n in g})) for g in _groups(list(meta))]  # shapes only: meta tensors
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for _, converted in plan:
        for key, t in converted.items():
            nbytes = t.numel() * t.element_size()
            header[key] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                           "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for group, converted in plan:
            real = convert({n: expected_tensor(component, n, meta[n], seed, dtype) for n in group})
            if list(real) != list(converted):
                raise RuntimeError(f"{path}: the conversion of {group[0]}... changed its keys between passes")
            for t in real.values():  # little-endian rows, as safetensors stores them
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return offset


def write_authors_checkpoint(out: str | Path, version: str = "480p_t2v", *, seed: int = 0,
                             text_layers: int = QWEN_TEXT_LAYERS, dtype: torch.dtype = torch.bfloat16,
                             max_shard_size: str = _DEFAULT_SHARD, configs: dict[str, dict] | None = None,
                             log=print) -> Path:
    """Write a random-weight checkpoint of the real shapes of `version` under `out` in the authors' layout
    (tencent/HunyuanVideo-1.5) -> `out`: transformer/<version>/ as one safetensors file in the authors' key names,
    vae/ in theirs, text_encoder/llm a whole Qwen2.5-VL checkpoint (the real vision tower beside the text tower, the
    hub's key names), the glyph ByT5 as Glyph-SDXL-v2's byt5_model.pt, and for I2V vision_encoder/siglip/.

    Every transformer, VAE, text-tower and image-encoder tensor holds the values `write_full_size_checkpoint(seed)`
    gives it (`expected_tensor`, by its diffusers name): a conversion of this layout must reproduce them. The
    tokenizers and the Glyph-SDXL-v2 colour and font lists are the tiny checkpoint's (the real ones are hub
    downloads); the glyph encoder's embedding covers them."""
    import time

    from transformers import ByT5Tokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from sage_grpo.files import usual_permissions
    from sage_grpo.models.authors_layout import SIGLIP_DIR, authors_vae_config, glyph_special_tokens
    from sage_grpo.models.convert import diffusers_to_authors_transformer, diffusers_to_authors_vae
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    out = Path(out)
    configs = configs if configs is not None else real_configs(version, text_layers)
    write_tiny_checkpoint(out, "authors", seed, version)  # the layout and every non-weight file
    done = []

    def report(what: str, params: int, nbytes: int, t0: float) -> None:
        log(f"  {what}: {params:,} parameters, {nbytes / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s")
        done.append(what)

    t0 = time.perf_counter()
    tr = build_on_meta("transformer", configs["transformer"])
    tdir = out / "transformer" / version
    for f in tdir.glob("*.safetensors"):
        f.unlink()
    n = _write_converted_file(tr, tdir / "diffusion_pytorch_model.safetensors", diffusers_to_authors_transformer,
                              "transformer", seed=seed, dtype=dtype)
    (tdir / "config.json").write_text(json.dumps({"rope_dim_list": list(tr.config.rope_axes_dim),
                                                  "target_size": tr.config.target_size}))
    report(f"transformer/{version}", sum(t.numel() for t in _unique_state(tr).values()), n, t0)

    t0 = time.perf_counter()
    vae = build_on_meta("vae", configs["vae"])
    n = _write_converted_file(vae, out / "vae/diffusion_pytorch_model.safetensors", diffusers_to_authors_vae, "vae",
                              seed=seed, dtype=dtype)
    (out / "vae/config.json").write_text(json.dumps(authors_vae_config(vae), indent=1))
    report("vae", sum(t.numel() for t in _unique_state(vae).values()), n, t0)

    # the MLLM: the whole Qwen2.5-VL, saved under the hub's key names (model.* text tower, visual.*, lm_head)
    t0 = time.perf_counter()
    text = configs["text_encoder"]
    vision = QWEN_VISION_CONFIG if text["hidden_size"] == QWEN_VISION_CONFIG["out_hidden_size"] else dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, fullatt_block_indexes=[0],
        out_hidden_size=text["hidden_size"])  # a miniature text tower: a miniature vision tower
    with torch.device("meta"):
        vl = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision))
    hub = {"model.language_model.": "model.", "model.visual.": "visual."}
    state = {}
    for name, t in _unique_state(vl).items():
        prefix = next((p for p in hub if name.startswith(p)), "")
        state[hub[prefix] + name[len(prefix):] if prefix else name] = t
    llm = out / "text_encoder/llm"
    for f in list(llm.glob("model*.safetensors*")):
        f.unlink()
    vl.config.dtype = dtype
    vl.config.save_pretrained(llm)
    def tower(key: str) -> str:  # the text tower's values are the diffusers checkpoint's text_encoder's
        return "text_encoder." + key[len("model."):] if key.startswith("model.") else "text_encoder_llm." + key

    n = _write_state(state, llm, "model", seed=seed, dtype=dtype, max_shard_size=max_shard_size, value_name=tower)
    report("text_encoder/llm (Qwen2.5-VL)", sum(t.numel() for t in state.values()), n, t0)

    # the glyph encoder: byt5-small's config, Glyph-SDXL-v2's weights with the added colour and font rows
    t0 = time.perf_counter()
    byt5 = build_on_meta("text_encoder_2", configs["text_encoder_2"])
    byt5.config.save_pretrained(out / "text_encoder/byt5-small")
    glyph = out / "text_encoder/Glyph-SDXL-v2"
    tokenizer = ByT5Tokenizer.from_pretrained(out / "text_encoder/byt5-small")
    tokenizer.add_tokens(glyph_special_tokens(glyph), special_tokens=True)
    rows = len(tokenizer)  # the loader resizes the embedding to this
    glyph_state = {}
    for name, t in byt5.state_dict(keep_vars=True).items():  # with encoder.embed_tokens (tied to shared)
        if not name.startswith("encoder."):
            continue
        meta = torch.empty((rows, t.shape[1]), device="meta") if name == "encoder.embed_tokens.weight" else t
        glyph_state["module.text_tower.encoder." + name[len("encoder."):]] = expected_tensor(
            "text_encoder_2", name, meta, seed, dtype)
    torch.save(glyph_state, glyph / "checkpoints/byt5_model.pt")
    report("Glyph-SDXL-v2 byt5_model.pt", sum(t.numel() for t in glyph_state.values()),
           sum(t.numel() * t.element_size() for t in glyph_state.values()), t0)
    del glyph_state

    if "image_encoder" in configs:
        t0 = time.perf_counter()
        siglip = build_on_meta("image_encoder", configs["image_encoder"])
        folder = out / SIGLIP_DIR / "image_encoder"
        shutil.rmtree(folder)
        folder.mkdir()
        siglip.config.dtype = dtype
        siglip.config.save_pretrained(folder)
        n = _write_weights(siglip, folder, diffusers=False, seed=seed, dtype=dtype, max_shard_size=max_shard_size,
                           prefix="image_encoder.")
        _write_processor(out / SIGLIP_DIR / "feature_extractor", configs["image_encoder"])
        report(f"{SIGLIP_DIR} (SigLIP)", sum(t.numel() for t in _unique_state(siglip).values()), n, t0)
    _write_text_lengths(out, configs)
    return usual_permissions(out)


def checkpoint_bytes(root: str | Path) -> int:
    """Bytes of every file under `root`."""
    return sum(f.stat().st_size for f in Path(root).rglob("*") if f.is_file())
