"""Write a tiny random HunyuanVideo-1.5 checkpoint in either layout (used by scripts/make_tiny_checkpoint.py,
the tiny default of generate.py and post_train.py, and the tests). It loads through exactly the code path of real
weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from sage_grpo.files import usual_permissions
from sage_grpo.models.tiny import TEXT_LENGTHS_FILE, build_tiny_components, tiny_variant_config, variant_of

__all__ = ["TINY_CHECKPOINT_DIR", "write_tiny_checkpoint", "ensure_tiny_checkpoint"]

# Where configs/tiny_cpu.yaml and scripts/demo.sh expect the diffusers-layout tiny model.
TINY_CHECKPOINT_DIR = "outputs/tiny_ckpts/hunyuanvideo15"


def write_tiny_checkpoint(out: str | Path, layout: str = "diffusers", seed: int = 0, version: str = "480p_t2v") -> Path:
    """Build tiny components from `seed` and save them under `out` -> `out`. Same seed = same weights. An I2V
    version (its name holds "i2v", e.g. 480p_i2v) adds a tiny SigLIP image encoder and its processor: in the
    diffusers layout as HunyuanVideo15ImageToVideoPipeline saves them (image_encoder/, feature_extractor/, listed in
    model_index.json), in the authors' layout under vision_encoder/siglip/ where their loader reads them."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler

    variant = variant_of(version)  # an unknown or unsupported name is one error here
    task = variant.task
    comps = build_tiny_components(seed, task=task, transformer_config=tiny_variant_config(version))
    lengths = comps.pop("text_lengths")
    # the version's own sampling defaults, where the real checkpoint keeps them (scheduler/, guider/)
    comps["scheduler"] = FlowMatchEulerDiscreteScheduler(shift=variant.flow_shift)
    comps["guider"] = ClassifierFreeGuidance(guidance_scale=variant.guidance_scale)
    if layout == "diffusers":
        cls = HunyuanVideo15ImageToVideoPipeline if task == "i2v" else HunyuanVideo15Pipeline
        cls(**comps).save_pretrained(out, safe_serialization=True)
    elif layout == "authors":
        from sage_grpo.models.authors_layout import save_authors_layout

        save_authors_layout(comps, out, version)
    else:
        raise ValueError(f"layout must be 'diffusers' or 'authors', got {layout!r}")
    (out / TEXT_LENGTHS_FILE).write_text(json.dumps(lengths.to_dict(), indent=1) + "\n")
    return usual_permissions(out)  # safetensors writes 0600; the tiny model is shared like real weights


def ensure_tiny_checkpoint(model_path: str | Path, *, is_main: bool, log: Callable[[str], None] = print) -> None:
    """Build the tiny default model on first use (seconds) when `model_path` is TINY_CHECKPOINT_DIR and holds none
    yet; any other path is left alone (real weights are never fetched). Collective: the main rank writes, every
    rank waits at a barrier, so no rank loads a half-written model."""
    from sage_grpo.parallel.dist import barrier

    target = Path(model_path) if model_path else None
    if is_main and target == Path(TINY_CHECKPOINT_DIR) and not (target / "model_index.json").exists():
        log(f"building the tiny random model at {target} (scripts/make_tiny_checkpoint.py)")
        write_tiny_checkpoint(target)
    barrier()
