"""Read the authors' checkpoint layout (tencent/HunyuanVideo-1.5) into diffusers' classes, and write it (tiny).

Facts from the authors' loader and diffusers' converter: the transformer and VAE are safetensors in the authors'
key names (mapped by sage_grpo.models.convert); the MLLM is a full Qwen2.5-VL checkpoint whose text tower is used;
the glyph encoder is google/byt5-small's architecture with its tokenizer extended by color and font tokens
(`<color-i>`, `<xx-font-j>` from the Glyph-SDXL-v2 assets) and the weights of `checkpoints/byt5_model.pt` (keys
optionally prefixed `module.text_tower.encoder.`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sage_grpo.errors import SageGRPOError
from sage_grpo.models.convert import (
    authors_to_diffusers_transformer,
    authors_to_diffusers_vae,
    diffusers_to_authors_transformer,
    diffusers_to_authors_vae,
    infer_transformer_config,
)

__all__ = [
    "load_authors_parts",
    "load_authors_transformer",
    "load_authors_vae",
    "authors_vae_config",
    "glyph_special_tokens",
    "save_authors_layout",
    "SIGLIP_DIR",
]

# The authors' image encoder folder (checkpoints-download.md: FLUX.1-Redux-dev's image_encoder/ and
# feature_extractor/ downloaded into ckpts/vision_encoder/siglip).
SIGLIP_DIR = "vision_encoder/siglip"

# Authors' VAE config names -> AutoencoderKLHunyuanVideo15 arguments.
_VAE_ALIASES = {"ffactor_spatial": "spatial_compression_ratio", "ffactor_temporal": "temporal_compression_ratio"}


def _load_safetensors_dir(d: Path) -> dict[str, torch.Tensor]:
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise SageGRPOError(f"no *.safetensors weights in {d}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def _meta_state_of_dir(d: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors directory as meta tensors (shapes from the file headers, no data read)."""
    from safetensors import safe_open

    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise SageGRPOError(f"no *.safetensors weights in {d}")
    state = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                state[k] = torch.empty(h.get_slice(k).get_shape(), device="meta")
    return state


def authors_transformer_config(d: Path, version: str, state: dict[str, torch.Tensor] | None = None) -> dict:
    """HunyuanVideo15Transformer3DModel kwargs of transformer/<version>/ (authors' keys): shapes from `state` or,
    when None, from the file headers (nothing loaded), the rope split and bucket base from its config.json."""
    state = state if state is not None else _meta_state_of_dir(d)
    overrides = {}
    cfg_file = d / "config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        rope = cfg.get("rope_axes_dim", cfg.get("rope_dim_list"))
        overrides = {"rope_axes_dim": rope} if rope else {}
        if "target_size" in cfg:
            overrides["target_size"] = int(cfg["target_size"])
    config = infer_transformer_config(state, version, rope_axes_dim=overrides.pop("rope_axes_dim", None))
    config.update(overrides)
    return config


def load_authors_transformer(d: Path, version: str, dtype: torch.dtype):
    """transformer/<version>/ (authors' keys) -> HunyuanVideo15Transformer3DModel in `dtype`."""
    from diffusers import HunyuanVideo15Transformer3DModel

    state = _load_safetensors_dir(d)
    config = authors_transformer_config(d, version, state)
    converted = authors_to_diffusers_transformer(state)
    with torch.device("meta"):
        model = HunyuanVideo15Transformer3DModel(**config)
    model.load_state_dict(converted, strict=True, assign=True)
    return model.to(dtype)


def load_authors_vae(d: Path, dtype: torch.dtype):
    """vae/ (authors' keys and config names) -> AutoencoderKLHunyuanVideo15 in `dtype`."""
    import inspect

    from diffusers import AutoencoderKLHunyuanVideo15

    raw = json.loads((d / "config.json").read_text())
    allowed = set(inspect.signature(AutoencoderKLHunyuanVideo15.__init__).parameters) - {"self"}
    config = {_VAE_ALIASES.get(k, k): v for k, v in raw.items()}
    config = {k: v for k, v in config.items() if k in allowed}
    state = _load_safetensors_dir(d)
    if not any(k.startswith("encoder.down_blocks.") for k in state):  # authors' names; else already diffusers'
        state = authors_to_diffusers_vae(state)
    with torch.device("meta"):
        model = AutoencoderKLHunyuanVideo15(**config)
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(dtype)


def glyph_special_tokens(glyph_root: Path) -> list[str]:
    """Color then font tokens, in the order the authors add them."""
    colors = json.loads((glyph_root / "assets/color_idx.json").read_text())
    fonts = json.loads((glyph_root / "assets/multilingual_10-lang_idx.json").read_text())
    return [f"<color-{i}>" for i in range(len(colors))] + [f"<{code[:2]}-font-{fonts[code]}>" for code in fonts]


def _load_glyph_byt5(root: Path, dtype: torch.dtype):
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    byt5_dir = root / "text_encoder/byt5-small"
    glyph = root / "text_encoder/Glyph-SDXL-v2"
    has_tokenizer = (byt5_dir / "tokenizer_config.json").exists()
    tokenizer = ByT5Tokenizer.from_pretrained(os.fspath(byt5_dir)) if has_tokenizer else ByT5Tokenizer()
    tokenizer.add_tokens(glyph_special_tokens(glyph), special_tokens=True)
    config = T5Config.from_pretrained(os.fspath(byt5_dir))
    encoder = T5EncoderModel(config)
    encoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    ckpt = torch.load(glyph / "checkpoints/byt5_model.pt", map_location="cpu", weights_only=True)
    state = ckpt.get("state_dict", ckpt)
    prefix = "module.text_tower.encoder."
    state = {("encoder." + k[len(prefix):] if k.startswith(prefix) else "encoder." + k): v for k, v in state.items()}
    missing, unexpected = encoder.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "shared.weight"]  # tied to encoder.embed_tokens
    if missing or unexpected:
        raise SageGRPOError(f"Glyph-SDXL-v2 byt5_model.pt does not fit byt5-small: missing {missing[:5]}, unexpected "
                            f"{unexpected[:5]}")
    return encoder.to(dtype), tokenizer


def load_authors_parts(root: Path, version: str, tdt, vdt, dt, load_text_encoders: bool,
                       load_transformer: bool = True) -> dict:
    from transformers import AutoTokenizer

    llm = root / "text_encoder/llm"
    parts = dict(
        transformer=load_authors_transformer(root / "transformer" / version, version, tdt) if load_transformer
        else None,
        vae=load_authors_vae(root / "vae", vdt),
        tokenizer=AutoTokenizer.from_pretrained(os.fspath(llm), padding_side="right"),
        text_encoder=None,
        text_encoder_2=None,
    )
    text_encoder_2, tokenizer_2 = _load_glyph_byt5(root, dt)
    parts["tokenizer_2"] = tokenizer_2
    if load_text_encoders:
        parts["text_encoder"] = _load_mllm_text_tower(llm, dt)
        parts["text_encoder_2"] = text_encoder_2
    return parts


def _load_mllm_text_tower(llm: Path, dt):
    from transformers import AutoModel

    mllm = AutoModel.from_pretrained(os.fspath(llm), dtype=dt)  # Qwen2_5_VLModel: vision + text towers
    return getattr(mllm, "language_model", mllm)  # keep the text tower only


def load_authors_text_encoders(root: Path, dt) -> tuple:
    """(MLLM text tower, glyph ByT5 encoder) of the authors' layout, nothing else."""
    return _load_mllm_text_tower(root / "text_encoder/llm", dt), _load_glyph_byt5(root, dt)[0]


def authors_vae_config(vae) -> dict:
    """The VAE's config under the authors' names (the inverse of _VAE_ALIASES)."""
    config = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
    return {next((a for a, d in _VAE_ALIASES.items() if d == k), k): v for k, v in config.items()}


def save_authors_layout(components: dict, root: Path, version: str = "480p_t2v") -> None:
    """Write `components` (diffusers classes, see sage_grpo.models.tiny) in the authors' layout (for tests)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    root = Path(root)
    tdir = root / "transformer" / version
    tdir.mkdir(parents=True, exist_ok=True)
    tr = components["transformer"]
    save_file({k: v.contiguous() for k, v in diffusers_to_authors_transformer(tr.state_dict()).items()},
              tdir / "diffusion_pytorch_model.safetensors")
    (tdir / "config.json").write_text(json.dumps({"rope_dim_list": list(tr.config.rope_axes_dim),
                                                  "target_size": tr.config.target_size}))

    vdir = root / "vae"
    vdir.mkdir(parents=True, exist_ok=True)
    vae = components["vae"]
    save_file({k: v.contiguous() for k, v in diffusers_to_authors_vae(vae.state_dict()).items()},
              vdir / "diffusion_pytorch_model.safetensors")
    (vdir / "config.json").write_text(json.dumps(authors_vae_config(vae), indent=1))

    # The MLLM as a full Qwen2.5-VL (tiny vision tower) whose language model is the tiny text tower.
    te = components["text_encoder"]
    tcfg = te.config.to_dict()
    vl_cfg = Qwen2_5_VLConfig(
        text_config=tcfg,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=tcfg["hidden_size"], fullatt_block_indexes=[0]),
    )
    vl = Qwen2_5_VLForConditionalGeneration(vl_cfg)
    vl.model.language_model.load_state_dict(te.state_dict())
    vl.save_pretrained(root / "text_encoder/llm")
    components["tokenizer"].save_pretrained(root / "text_encoder/llm")

    byt5_dir = root / "text_encoder/byt5-small"
    components["text_encoder_2"].config.save_pretrained(byt5_dir)
    components["tokenizer_2"].save_pretrained(byt5_dir)
    glyph = root / "text_encoder/Glyph-SDXL-v2"
    (glyph / "assets").mkdir(parents=True, exist_ok=True)
    (glyph / "checkpoints").mkdir(parents=True, exist_ok=True)
    (glyph / "assets/color_idx.json").write_text(json.dumps({"white": 0, "black": 1}))
    (glyph / "assets/multilingual_10-lang_idx.json").write_text(json.dumps({"en-font-0": 0, "zh-font-1": 1}))
    # The glyph weights include the embedding rows of the added tokens: resize a copy, save its encoder keys.
    import copy

    enc = copy.deepcopy(components["text_encoder_2"])
    n_added = len(glyph_special_tokens(glyph))
    enc.resize_token_embeddings(len(components["tokenizer_2"]) + n_added, mean_resizing=False)
    state = {"module.text_tower.encoder." + k[len("encoder."):]: v.clone()
             for k, v in enc.state_dict().items() if k.startswith("encoder.")}
    torch.save(state, glyph / "checkpoints/byt5_model.pt")

    if components.get("image_encoder") is not None:  # I2V: where the authors' loader reads SigLIP (HVP L1607-1623)
        siglip = root / SIGLIP_DIR
        components["image_encoder"].save_pretrained(siglip / "image_encoder")
        components["feature_extractor"].save_pretrained(siglip / "feature_extractor")
