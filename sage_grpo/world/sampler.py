"""Seeded clips of the world and its train / held-out split.

The held-out split holds the (colour, shape) pairs listed in `HELDOUT_PAIRS`: one shape per colour, so every colour
and every shape is still seen in training, only never together. A clip is held out when any of its objects is such
a pair. Evaluating on held-out captions asks whether a model composes attributes it learnt apart.

Determinism: clip ``index`` of ``(seed, split)`` comes from its own `random.Random`, seeded with a string (Python
hashes string seeds with SHA-512, the same on every platform and run), so clips can be drawn in any order, by
any worker, and are the same.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.world.captions import COLORS, MOTIONS, SHAPES, SIZES, Attributes, ObjectAttrs, make_caption
from sage_grpo.world.render import DEFAULT_FRAMES, DEFAULT_SIZE, Scene, layout, render

__all__ = [
    "HELDOUT_PAIRS",
    "SPLITS",
    "WorldClip",
    "is_heldout",
    "sample_attributes",
    "sample_clip",
    "iter_clips",
    "world_captions",
    "single_object_attributes",
]

SPLITS = ("train", "heldout")
# colour i is held out with shape i mod 3: red circle, yellow square, green triangle, blue circle, ...
HELDOUT_PAIRS: frozenset[tuple[str, str]] = frozenset(
    (color, SHAPES[i % len(SHAPES)]) for i, color in enumerate(COLORS)
)


@dataclass(frozen=True)
class WorldClip:
    """One sample: the video, its caption and the attributes the caption names (and the scene it was drawn from)."""

    video: torch.Tensor  # float32 [F, 3, H, W] in [0, 1]
    caption: str
    attributes: Attributes
    scene: Scene


def is_heldout(attrs: Attributes) -> bool:
    """True when any object of ``attrs`` is a held-out (colour, shape) pair."""
    return any((o.color, o.shape) in HELDOUT_PAIRS for o in attrs.objects)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise SageGRPOError(f"unknown world split {split!r}; use one of: {', '.join(SPLITS)}")


def sample_attributes(rng: random.Random, split: str = "train", two_object_prob: float = 0.25) -> Attributes:
    """Draw attributes uniformly over the vocabulary, one or two objects, until they fall in ``split``."""
    _check_split(split)
    if not 0.0 <= two_object_prob <= 1.0:
        raise SageGRPOError(f"two_object_prob must be in [0, 1], got {two_object_prob}")
    names = list(COLORS)
    for _ in range(10_000):  # about 1 in 2 draws lands in either split, so this never runs out in practice
        n = 2 if rng.random() < two_object_prob else 1
        colors = rng.sample(names, n + 1)  # distinct: objects, then background
        objects = tuple(ObjectAttrs(rng.choice(SIZES), c, rng.choice(SHAPES)) for c in colors[:n])
        attrs = Attributes(objects, rng.choice(MOTIONS), colors[n])
        if is_heldout(attrs) == (split == "heldout"):
            return attrs
    raise RuntimeError("sample_attributes found no attributes in the split")  # unreachable with this vocabulary


def sample_clip(seed: int, index: int = 0, split: str = "train", size: int = DEFAULT_SIZE,
                num_frames: int = DEFAULT_FRAMES, two_object_prob: float = 0.25) -> WorldClip:
    """Clip ``index`` of the stream ``(seed, split)``; the same arguments always give the same clip."""
    _check_split(split)
    rng = random.Random(f"sage-grpo-world:{split}:{seed}:{index}")
    attrs = sample_attributes(rng, split, two_object_prob)
    scene = layout(attrs, rng, size, num_frames)
    return WorldClip(render(scene), make_caption(attrs), attrs, scene)


def iter_clips(seed: int, split: str = "train", start: int = 0, **kwargs) -> Iterator[WorldClip]:
    """Endless stream of clips ``start, start + 1, ...`` of ``(seed, split)``; kwargs as `sample_clip`."""
    index = start
    while True:
        yield sample_clip(seed, index, split, **kwargs)
        index += 1


def world_captions(n: int, seed: int = 0, split: str = "train", two_object_prob: float = 0.25) -> list[str]:
    """The captions of the first ``n`` clips of ``(seed, split)`` (no rendering), e.g. for a prompt file."""
    _check_split(split)
    out = []
    for index in range(n):
        rng = random.Random(f"sage-grpo-world:{split}:{seed}:{index}")
        out.append(make_caption(sample_attributes(rng, split, two_object_prob)))
    return out


def single_object_attributes(split: str = "heldout") -> list[Attributes]:
    """Every one-object attribute set in ``split``, in a fixed order (the exhaustive evaluation grid)."""
    _check_split(split)
    out = []
    for color in COLORS:
        for shape in SHAPES:
            for size in SIZES:
                for motion in MOTIONS:
                    for bg in COLORS:
                        if bg == color:
                            continue
                        attrs = Attributes((ObjectAttrs(size, color, shape),), motion, bg)
                        if is_heldout(attrs) == (split == "heldout"):
                            out.append(attrs)
    return out
