"""Procedural clips of the synthetic world: seeded layouts and an anti-aliased rasteriser.

Geometry. The default clip is 9 frames of 32 x 32 px. Frame counts are 4k + 1 because HunyuanVideo-1.5's VAE (and
the tiny one in `sage_grpo.models.tiny`) compresses time 4x after a lone first frame: 9 frames -> 3 latent frames.
The tiny VAE compresses space 4x (the real one 16x), so 32 px gives an 8 x 8 latent grid, 192 transformer tokens
for 9 frames: small enough to pretrain and post-train on 2 CPU cores, and it is the size configs/tiny_cpu.yaml
already rolls out (height and width must be multiples of 16). A small object is 8 px across at 32 px (2 x 2 latent
cells), a large one ~13 px; everything scales with the frame size, so 64 px / 17 frames work as well.

Motion. Objects move in a straight line (left, right, up, down) or bounce: out to a wall of the frame, reversing
there in the middle fifth of the clip, and back. Straight travel and a bounce's longer leg are 25-45% of the frame,
so a detector can tell motion from jitter and a bounce (net displacement < 0.5 of the excursion) from a line.
Two objects share the motion and move in separate lanes (top/bottom half for horizontal motion, left/right for
vertical) with a gap of a tenth of the frame between the lanes, so they never overlap and a slight blur does not
join them into one blob.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sage_grpo.errors import SageGRPOError
from sage_grpo.world.captions import COLORS, Attributes, ObjectAttrs, parse_caption

__all__ = [
    "DEFAULT_SIZE",
    "DEFAULT_FRAMES",
    "RADIUS_FRAC",
    "ObjectPath",
    "Scene",
    "check_geometry",
    "layout",
    "render",
    "render_caption",
    "shape_coverage",
]

DEFAULT_SIZE, DEFAULT_FRAMES = 32, 9
# half the side of an object's bounding box, as a fraction of the frame side
# (two large objects and the lane gap fit across the frame: 4 * 0.2 + 0.1 < 1)
RADIUS_FRAC = {"small": 0.125, "large": 0.2}
_TRAVEL_FRAC = (0.25, 0.45)  # straight travel / a bounce's longer leg, fraction of the frame side
_MARGIN_PX = 0.5  # gap between an object and the frame border (a bounce touches this line)
_LANE_GAP_FRAC = 0.1  # free band between the two lanes of a two-object clip, fraction of the frame side
_AA = 4  # supersampling factor per axis: edge pixels get their true coverage, so sub-pixel motion is visible


@dataclass(frozen=True)
class ObjectPath:
    """Where one object is in every frame: ``centre(t) = start + velocity * (k - |k - t|)`` when it bounces at
    frame time k, ``start + velocity * t`` otherwise (pixel units, x to the right, y down)."""

    attrs: ObjectAttrs
    radius: float  # px, half the bounding-box side
    start: tuple[float, float]  # (x, y) centre at frame 0, px
    velocity: tuple[float, float]  # px per frame
    bounce_at: float | None = None  # frame time of the reversal; None for straight motion

    def centres(self, num_frames: int) -> torch.Tensor:
        """Centres [F, 2] (x, y) in px, float64 (exact enough that re-rendering is bit-identical)."""
        t = torch.arange(num_frames, dtype=torch.float64)  # [F]
        if self.bounce_at is not None:
            t = self.bounce_at - (self.bounce_at - t).abs()  # time runs back after the wall
        start, velocity = (torch.tensor(v, dtype=torch.float64) for v in (self.start, self.velocity))
        return start + t[:, None] * velocity


@dataclass(frozen=True)
class Scene:
    """A clip to draw: its caption-level attributes and the geometry the seed chose."""

    attrs: Attributes
    paths: tuple[ObjectPath, ...]  # same order as attrs.objects
    size: int = DEFAULT_SIZE
    num_frames: int = DEFAULT_FRAMES


def check_geometry(size: int, num_frames: int) -> None:
    """Raise SageGRPOError unless the clip geometry suits the world and the VAE (frames 4k+1, size a multiple of 16)."""
    if num_frames < 5 or (num_frames - 1) % 4:
        raise SageGRPOError(f"world clips need 4k+1 frames (>= 5; e.g. 9 or 17) for the 4x temporal VAE, got "
                            f"{num_frames}")
    if size < 32 or size % 16:
        raise SageGRPOError(f"world clips need a frame side that is a multiple of 16 and >= 32 (e.g. 32 or 64), got "
                            f"{size}")


def _travel_range(size: int, free: float) -> tuple[float, float]:
    lo, hi = (f * size for f in _TRAVEL_FRAC)
    return min(lo, free), min(hi, free)


def layout(attrs: Attributes, rng: random.Random, size: int = DEFAULT_SIZE, num_frames: int = DEFAULT_FRAMES) -> Scene:
    """Choose positions, lanes and speeds for ``attrs`` from ``rng`` (same rng state -> same scene)."""
    check_geometry(size, num_frames)
    steps = num_frames - 1
    motion = attrs.motion
    axis = {"left": 0, "right": 0, "up": 1, "down": 1}.get(motion)
    if axis is None:  # a bounce runs along a random axis
        axis = rng.randrange(2)
    n = len(attrs.objects)
    lanes = list(range(n))
    rng.shuffle(lanes)  # which object takes the top (left) lane
    bounce_at = rng.uniform(0.4, 0.6) * steps if motion == "bounces" else None
    paths = []
    for obj, lane in zip(attrs.objects, lanes):
        r = RADIUS_FRAC[obj.size] * size
        lo, hi = r + _MARGIN_PX, size - r - _MARGIN_PX  # centre range along the motion axis
        if n == 1:
            across = rng.uniform(lo, hi)
        else:  # lane 0 ends, and lane 1 starts, half the gap away from the middle of the frame
            half_gap = _LANE_GAP_FRAC * size / 2
            a_lo, a_hi = (lo, size / 2 - half_gap - r) if lane == 0 else (size / 2 + half_gap + r, hi)
            across = rng.uniform(a_lo, a_hi)
        t_lo, t_hi = _travel_range(size, hi - lo)
        leg = rng.uniform(t_lo, t_hi)
        if bounce_at is None:
            sign = 1.0 if motion in ("right", "down") else -1.0
            along = rng.uniform(lo, hi - leg) if sign > 0 else rng.uniform(lo + leg, hi)
            speed = leg / steps
            bounce = None
        else:
            sign = rng.choice((1.0, -1.0))  # towards the far (+1) or the near (-1) wall
            speed = leg / max(bounce_at, steps - bounce_at)  # the longer leg is `leg`
            wall = hi if sign > 0 else lo
            along = wall - sign * speed * bounce_at
            bounce = bounce_at
        start = (along, across) if axis == 0 else (across, along)
        vel = (sign * speed, 0.0) if axis == 0 else (0.0, sign * speed)
        paths.append(ObjectPath(obj, r, start, vel, bounce))
    return Scene(attrs, tuple(paths), size, num_frames)


def shape_coverage(shape: str, centres: torch.Tensor, radii: torch.Tensor, height: int, width: int,
                   aa: int = _AA) -> torch.Tensor:
    """Fraction of each pixel covered by ``shape``: [N, H, W] in [0, 1] for N boxes.

    ``centres`` [N, 2] (x, y) and ``radii`` [N, 2] (half width, half height) in px; a circle in a non-square box is
    an ellipse, a triangle points up with its base on the box's bottom edge. ``aa`` samples per pixel and axis.
    """
    ys = (torch.arange(height * aa, dtype=torch.float64) + 0.5) / aa  # [H*aa] sample y, px
    xs = (torch.arange(width * aa, dtype=torch.float64) + 0.5) / aa  # [W*aa]
    dx = (xs[None, None, :] - centres[:, 0, None, None]) / radii[:, 0, None, None]  # [N, 1, W*aa], box units
    dy = (ys[None, :, None] - centres[:, 1, None, None]) / radii[:, 1, None, None]  # [N, H*aa, 1]
    if shape == "circle":
        inside = dx.square() + dy.square() <= 1.0
    elif shape == "square":
        inside = (dx.abs() <= 1.0) & (dy.abs() <= 1.0)
    elif shape == "triangle":
        # apex at dy = -1, base at dy = +1 of half-width 1: |dx| <= (dy + 1) / 2
        inside = (dy <= 1.0) & (dx.abs() <= (dy + 1.0) / 2.0)
    else:
        raise SageGRPOError(f"unknown shape {shape!r}; the world draws circle, square, triangle")
    inside = inside.expand(-1, height * aa, width * aa).to(torch.float32)  # [N, H*aa, W*aa]
    return F.avg_pool2d(inside[:, None], aa)[:, 0]  # [N, H, W]


def render(scene: Scene) -> torch.Tensor:
    """The clip: float32 [F, 3, H, W] in [0, 1] (the project's frame convention, see sage_grpo.video)."""
    size, nf = scene.size, scene.num_frames
    bg = torch.tensor(COLORS[scene.attrs.background], dtype=torch.float32)
    video = bg.view(1, 3, 1, 1).expand(nf, 3, size, size).clone()  # [F, 3, H, W]
    for path in scene.paths:
        centres = path.centres(nf)  # [F, 2]
        radii = torch.full((nf, 2), path.radius, dtype=torch.float64)
        cov = shape_coverage(path.attrs.shape, centres, radii, size, size)[:, None]  # [F, 1, H, W]
        col = torch.tensor(COLORS[path.attrs.color], dtype=torch.float32).view(1, 3, 1, 1)
        video = video * (1.0 - cov) + col * cov
    return video


def render_caption(caption: str, seed: int = 0, size: int = DEFAULT_SIZE,
                   num_frames: int = DEFAULT_FRAMES) -> torch.Tensor:
    """Render a world caption with a layout drawn from ``seed``: float32 [F, 3, H, W] in [0, 1]."""
    return render(layout(parse_caption(caption), random.Random(seed), size, num_frames))
