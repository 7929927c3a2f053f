"""Quality of a model of the world, measured with the detectors: ODE samples of fixed captions and seeds, and the
share whose object colour, shape and motion match the caption, with frame sharpness and temporal consistency.

Used by scripts/eval_tiny.py (the report), the committed model's test, and the video lab.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.world.captions import make_caption, parse_caption
from sage_grpo.world.metrics import caption_scores, temporal_consistency
from sage_grpo.world.render import layout, render, render_caption
from sage_grpo.world.sampler import single_object_attributes

__all__ = ["TARGETS", "eval_captions", "sharpness", "quality", "first_frame_error", "first_frame",
           "write_first_frames", "sample_world_videos"]

# The quality targets for the pretrained tiny model (chance: colour 1/6 of the non-background colours,
# shape 1/3, motion 1/5).
TARGETS = {"color": 0.8, "shape": 0.5, "motion": 0.6}


def eval_captions(n: int, split: str = "heldout") -> list[str]:
    """``n`` one-object captions of ``split`` spread evenly over its exhaustive grid (colours, shapes, sizes,
    motions and backgrounds all vary), in a fixed order."""
    grid = single_object_attributes(split)
    if not 1 <= n <= len(grid):
        raise ValueError(f"the {split} split has {len(grid)} one-object captions; ask for 1 to {len(grid)}")
    return [make_caption(grid[(i * len(grid)) // n]) for i in range(n)]


def sharpness(videos: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of horizontally and vertically adjacent pixels: [B]. A blurred frame scores lower;
    compare with rendered clips of the same captions (`quality` reports the ratio)."""
    v = videos.detach().float().clamp(0, 1)  # [B, F, 3, H, W]
    dx = (v[..., :, 1:] - v[..., :, :-1]).abs().mean(dim=(1, 2, 3, 4))
    dy = (v[..., 1:, :] - v[..., :-1, :]).abs().mean(dim=(1, 2, 3, 4))
    return (dx + dy) / 2


def quality(videos: torch.Tensor, captions: Sequence[str], seeds: Sequence[int]) -> dict[str, float]:
    """videos [B, F, 3, H, W] in [0, 1] sampled for ``captions`` -> the shares of videos whose detected attributes
    match the caption (``color``, ``shape``, ``motion``, ``size``, ``background``), ``sharpness_ratio`` (the
    videos' sharpness over that of clips rendered for the same captions with layouts from ``seeds``) and the mean
    ``temporal_consistency``."""
    scores = caption_scores(videos, list(captions))
    rendered = torch.stack([render_caption(c, seed=s, size=videos.shape[-1], num_frames=videos.shape[1])
                            for c, s in zip(captions, seeds)])
    out = {k: float(scores[k].mean()) for k in ("color", "shape", "motion", "size", "background", "agreement")}
    sizes = [parse_caption(c).objects[0].size for c in captions]
    for size in ("small", "large"):  # small objects are the harder half for motion: fewer pixels to track
        pick = torch.tensor([s == size for s in sizes])
        out[f"motion_{size}"] = float(scores["motion"][pick].float().mean()) if pick.any() else float("nan")
    out["sharpness_ratio"] = float(sharpness(videos).mean() / sharpness(rendered).mean())
    out["temporal_consistency"] = float(temporal_consistency(videos).mean())
    out["videos"] = len(captions)
    return out


def first_frame_error(videos: torch.Tensor, references: torch.Tensor) -> torch.Tensor:
    """Mean absolute pixel difference between each video's first frame and its reference image: [B] (0 = the
    reference itself). videos [B, F, 3, H, W], references [B, 3, H, W], both in [0, 1]."""
    return (videos[:, 0].float().clamp(0, 1) - references.float()).abs().mean(dim=(1, 2, 3))


def first_frame(caption: str, seed: int, size: int = 32, centred: bool = False) -> torch.Tensor:
    """Frame 0 of the caption's rendered clip (layout from ``seed``): [3, H, W] in [0, 1]. centred: a one-object
    caption's object at the frame centre instead. Rendered clips start a "moves right" object in the left part of
    the frame (it must have room to travel), so an image-to-video model can read the direction off the object's
    position; from the centre every direction has room and only the caption tells which."""
    if not centred:
        return render_caption(caption, seed=seed, size=size)[0]
    scene = layout(parse_caption(caption), random.Random(seed), size)
    if len(scene.paths) != 1:
        raise SageGRPOError(f"a centred first frame needs a one-object caption, not {caption!r}")
    path = dataclasses.replace(scene.paths[0], start=(size / 2, size / 2))
    return render(dataclasses.replace(scene, paths=(path,)))[0]


def write_first_frames(captions: Sequence[str], seeds: Sequence[int], folder, size: int = 32, centred: bool = False):
    """`first_frame` of each caption (layout from its seed) as a PNG in ``folder``: the I2V reference images of an
    evaluation -> (paths, frames [B, 3, H, W] in [0, 1] as the PNGs hold them)."""
    from pathlib import Path

    import PIL.Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths, frames = [], []
    for i, (c, s) in enumerate(zip(captions, seeds)):
        u8 = (first_frame(c, s, size, centred) * 255).round().to(torch.uint8)  # [3, H, W]
        path = folder / f"first_frame_{i:03d}.png"
        PIL.Image.fromarray(u8.permute(1, 2, 0).numpy()).save(path)
        paths.append(str(path))
        frames.append(u8.float() / 255)
    return paths, torch.stack(frames)


@torch.no_grad()
def sample_world_videos(pipe, captions: Sequence[str], *, steps: int, cfg_scale: float, shift: float = 5.0,
                        seed: int = 0, num_frames: int = 9, size: int = 32,
                        image_paths: Sequence[str] | None = None) -> torch.Tensor:
    """ODE samples of ``captions`` through the project's sampling path (sage_grpo.generation.sample_videos, as
    generate.py and validation): [B, F, 3, H, W] in [0, 1]. Caption i gets the noise of prompt index i.
    image_paths: one reference image per caption for an image-to-video checkpoint (`write_first_frames`)."""
    from sage_grpo.data import PromptRecord
    from sage_grpo.generation import sample_videos
    from sage_grpo.models.image_cond import ImageConditioningCache
    from sage_grpo.models.text_cache import TextEmbeddingCache
    from sage_grpo.rollout import SamplerSettings, latent_shape

    dtype = next(pipe.transformer.parameters()).dtype
    cache = TextEmbeddingCache(pipe, "cpu", dtype)
    settings = SamplerSettings(sde_type="ode", eta=0.0, num_steps=steps, shift=shift, cfg_scale=cfg_scale,
                               compute_dtype=dtype)
    shape = latent_shape(pipe.vae.config, num_frames, size, size)
    paths = list(image_paths) if image_paths is not None else [None] * len(captions)
    records = [PromptRecord(c, i, ref_image_path=p) for i, (c, p) in enumerate(zip(captions, paths))]
    images = ImageConditioningCache(pipe, "cpu", dtype) if image_paths is not None else None
    return torch.stack([frames for _, frames in sample_videos(pipe, cache, records, settings=settings, shape=shape,
                                                              base_seed=seed, negative_prompt="", images=images)])
