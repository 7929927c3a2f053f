"""Sampling videos for generate.py and for the training loop's validation, and writing them as samples.

    for rec, frames in sample_videos(pipe, cache, records, settings=settings, shape=shape, base_seed=930,
                                     negative_prompt=""):
        write_sample(out_dir / f"{sample_stem(rec)}.mp4", frames, prompt=rec.prompt, fps=24, meta={...})

Each prompt gets its own noise from (base seed, `record_noise_seed(record)`: the prompt text, the seed column or
index, and an image-to-video prompt's reference image) through the hash seeding of the rollout, so a video depends on
its prompt and seeds only: not on the other prompts, the rank count or the order. A sample on disk is `<stem>.mp4`,
`<stem>.txt` (the exact prompt, read back by scripts/score_videos.py) and, when given, `<stem>_config.json` (the
settings that made it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sage_grpo.data import PromptRecord
from sage_grpo.models.image_cond import image_digest
from sage_grpo.seeding import prompt_noise_seed
from sage_grpo.video import write_prompt_file, write_text_atomic, write_video

__all__ = ["record_noise_seed", "sample_videos", "write_sample", "sample_stem", "slug"]


def slug(text: str, n: int = 48) -> str:
    """File-name-safe excerpt of a prompt."""
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:n] or "video"


def sample_stem(rec: PromptRecord) -> str:
    """File stem of a prompt's sample: `<index:04d>_<slug of the prompt>` (the prompt itself goes into `.txt`)."""
    return f"{rec.index:04d}_{slug(rec.prompt)}"


def record_noise_seed(rec: PromptRecord) -> int:
    """The per-prompt part of a record's noise seed: `prompt_noise_seed` of its text, seed column (else index) and,
    for image-to-video, its reference image's content (the same image at another path gives the same noise)."""
    image = image_digest(rec.ref_image_path) if rec.ref_image_path else None
    return prompt_noise_seed(rec.prompt, rec.seed, rec.index, image)


@torch.no_grad()
def sample_videos(
    pipe,
    cache,
    records: Sequence[PromptRecord],
    *,
    settings,
    shape: tuple[int, int, int, int],
    base_seed: int,
    negative_prompt: str,
    show_progress: bool = False,
    decode: bool = True,
    images=None,
) -> Iterator[tuple[PromptRecord, Tensor | None]]:
    """Sample one video per record and yield (record, frames [F, 3, H, W] float32 in [0, 1], on CPU).

    pipe: a loaded HunyuanVideo-1.5 pipeline (`sage_grpo.models.loading.load_pipeline`): its transformer, VAE and
    `vision_num_semantic_tokens` are used. cache: `TextEmbeddingCache`; prompts missing from it are encoded on the
    fly (precompute and offload the encoders first to keep them off the device). records: this rank's share.
    settings: `sage_grpo.rollout.SamplerSettings` (`sde_type="ode"` for validation; an SDE sampler with its eta and
    sage_clamp otherwise). shape: latent [C, F, H, W] from `sage_grpo.rollout.latent_shape`. The transformer runs in
    eval mode (LoRA dropout off) and gets its previous mode back afterwards. decode=False yields None for the frames
    (the sequence-parallel peers of the rank that writes: they join every transformer forward, but the VAE decode
    is not collective and need not be repeated). images: `ImageConditioningCache` of an image-to-video checkpoint:
    each record's `ref_image_path` conditions its video, whose size is the image's bucket (`shape` gives the
    channels and frames only); None for text-to-video.
    """
    from sage_grpo.rollout import decode_latents, rollout

    transformer = pipe.transformer
    was_training = transformer.training
    transformer.eval()
    try:
        uncond = cache.get([negative_prompt]) if settings.use_cfg else None
        for rec in records:
            cond = cache.get([rec.prompt])
            image = images.get([rec.ref_image_path]) if images is not None else None
            if image is not None:
                shape = (*shape[:2], *image.latent_hw)  # [C, F, h, w]: the size of the image's bucket
            traj = rollout(
                transformer, cond, uncond, prompts=[rec.prompt], prompt_ids=torch.tensor([rec.index]),
                generation_ids=torch.zeros(1, dtype=torch.long),
                prompt_seeds=torch.tensor([record_noise_seed(rec)]),
                latent_shape=shape, settings=settings, image_tokens=pipe.vision_num_semantic_tokens,
                base_seed=base_seed, show_progress=show_progress, image=image,
            )
            if not decode:
                yield rec, None
                continue
            frames = decode_latents(pipe.vae, traj.final_latents)[0]  # [F, 3, H, W] fp32 in [0, 1]
            yield rec, frames.cpu()
    finally:
        transformer.train(was_training)


def write_sample(
    path: str | Path, frames: Tensor, *, prompt: str, fps: int, meta: dict[str, Any] | None = None
) -> Path:
    """Write `path` (.mp4, H.264), `<stem>.txt` with the exact prompt and, when `meta` is given,
    `<stem>_config.json` with it; folders are created. Returns the mp4 path."""
    path = Path(path)
    if path.suffix.lower() != ".mp4":
        raise ValueError(f"a sample is an .mp4 file, got {path}")
    write_video(path, frames, fps=fps)
    write_prompt_file(path, prompt)
    if meta is not None:
        write_text_atomic(path.with_name(path.stem + "_config.json"), json.dumps(meta, indent=1, default=str) + "\n")
    return path
