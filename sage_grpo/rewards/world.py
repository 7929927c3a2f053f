"""Rewards with exact answers on the synthetic world (`sage_grpo.world`): each reads a video with the world's
detectors, so on a rendered clip its value is known in closed form.

* ``world_caption``: share of the prompt's attributes (background, and each object's colour, shape, size and
  motion) that the detectors find in the video; 1.0 on the rendered clip of that caption.
* ``world_size``: share of the frame the largest object covers, mean over frames.
* ``world_color_share``: share of all pixels whose nearest named colour is the target (``world_color``, default
  red) and within `COLOR_TOL` of it.
* ``world_motion_right``: horizontal displacement of the largest object's centroid from its first to its last
  frame, over the frame width, in [-1, 1].
* ``world_motion``: displacement of the largest object's centroid from its first to its last frame along the
  direction the caption says (left, right, up or down), over the frame side, in [-1, 1]: the reward of
  configs/tiny_world_i2v.yaml.

They are deliberately hackable one-number targets (a huge object, a red screen, a drift to the right); the held-out
metrics in `sage_grpo.world.metrics` show what such a reward trades away. Detection runs on the CPU per video,
so the rewards that detect say `runs_on_cpu` (the trainer scores them while the rollout samples); world_color_share
is one tensor expression on the frames' device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.rewards.base import register_reward
from sage_grpo.world.captions import COLORS
from sage_grpo.world.detectors import detect, nearest_color, palette
from sage_grpo.world.metrics import ATTRIBUTE_KINDS, caption_scores

__all__ = ["COLOR_TOL", "WorldCaptionReward", "WorldSizeReward", "WorldColorShareReward", "WorldMotionRightReward",
           "WorldMotionReward"]

COLOR_TOL = 0.25  # a pixel counts as a named colour within this RGB distance (half the closest two names' gap)


def _check_videos(videos: torch.Tensor) -> None:
    """Raise ValueError unless ``videos`` is float [B, F, 3, H, W]."""
    if videos.ndim != 5 or videos.shape[2] != 3 or not videos.is_floating_point():
        raise ValueError(f"expected float videos [B, F, 3, H, W] in [0, 1], got {tuple(videos.shape)} {videos.dtype}")


class WorldCaptionReward:
    """Caption agreement in [0, 1]: the share of the prompt's attributes the detectors confirm. A prompt that is not
    a world caption raises SageGRPOError (`score_safely` turns that video's score into NaN)."""

    components = ("world_caption",)
    default_weights = {"world_caption": 1.0}
    runs_on_cpu = True  # the detectors work on CPU copies of the frames
    caption_kinds = ATTRIBUTE_KINDS  # the caption attributes it scores: not held out (sage_grpo.heldout)

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score [B, F, 3, H, W] -> {"world_caption": [B]}."""
        _check_videos(videos)
        return {"world_caption": caption_scores(videos, prompts)["agreement"].to(videos.device)}


class WorldSizeReward:
    """Mean over frames of the share of the frame the largest detected object covers, in [0, 1] (0: no object)."""

    components = ("world_size",)
    default_weights = {"world_size": 1.0}
    runs_on_cpu = True  # the detectors work on CPU copies of the frames
    caption_kinds = ("size",)

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score [B, F, 3, H, W] -> {"world_size": [B]}."""
        _check_videos(videos)
        out = []
        for v in videos:
            objs = detect(v).objects
            out.append(float(objs[0].area.mean()) if objs else 0.0)
        return {"world_size": torch.tensor(out, dtype=torch.float32, device=videos.device)}


class WorldColorShareReward:
    """Share of all pixels of all frames that are the named colour ``color`` (nearest name, within `COLOR_TOL`)."""

    components = ("world_color_share",)
    default_weights = {"world_color_share": 1.0}
    caption_kinds = ("color",)

    def __init__(self, color: str = "red"):
        """``color``: one of the world's colour names."""
        if color not in COLORS:
            raise SageGRPOError(f"world_color must be one of the world's colours ({', '.join(COLORS)}), got {color!r}")
        self.color = color
        self.index = palette()[0].index(color)

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score [B, F, 3, H, W] -> {"world_color_share": [B]}."""
        _check_videos(videos)
        rgb = videos.detach().float().clamp(0, 1).movedim(2, -1)  # [B, F, H, W, 3]
        idx, dist = nearest_color(rgb)  # [B, F, H, W] each
        hit = (idx == self.index) & (dist <= COLOR_TOL)
        return {"world_color_share": hit.float().mean(dim=(1, 2, 3))}


class WorldMotionRightReward:
    """(last x - first x) / width of the largest object's centroid over the frames it is found in, in [-1, 1];
    0 when no object is found in two frames."""

    components = ("world_motion_right",)
    default_weights = {"world_motion_right": 1.0}
    runs_on_cpu = True  # the detectors work on CPU copies of the frames
    caption_kinds = ("motion",)

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score [B, F, 3, H, W] -> {"world_motion_right": [B]}."""
        _check_videos(videos)
        width = videos.shape[-1]
        out = []
        for v in videos:
            d = _displacement(v)
            out.append(0.0 if d is None else float(d[0]) / width)
        return {"world_motion_right": torch.tensor(out, dtype=torch.float32, device=videos.device)}


def _displacement(video: torch.Tensor) -> torch.Tensor | None:
    """(x, y) px from the first to the last frame the largest object is found in; None when found in fewer than 2."""
    objs = detect(video).objects
    if not objs:
        return None
    track = objs[0].track  # [F, 2], NaN where absent
    track = track[~torch.isnan(track[:, 0])]
    return track[-1] - track[0] if track.shape[0] >= 2 else None


# the unit vector (x right, y down) of each straight motion of the world's captions
DIRECTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}


class WorldMotionReward:
    """Displacement of the largest object's centroid (first to last frame it is found in) along the caption's
    direction, over the frame side, in [-1, 1]; 0 when no object is found in two frames. A caption that says
    "bounces" has no direction: it is an error (NaN for that video through `score_safely`)."""

    components = ("world_motion",)
    default_weights = {"world_motion": 1.0}
    runs_on_cpu = True  # the detectors work on CPU copies of the frames
    caption_kinds = ("motion",)

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score [B, F, 3, H, W] for world captions -> {"world_motion": [B]}."""
        from sage_grpo.world.captions import parse_caption

        _check_videos(videos)
        if len(prompts) != videos.shape[0]:
            raise ValueError(f"{videos.shape[0]} videos but {len(prompts)} prompts")
        out = []
        for v, prompt in zip(videos, prompts):
            motion = parse_caption(prompt).motion
            if motion not in DIRECTIONS:
                raise SageGRPOError(f"world_motion scores captions that move left, right, up or down, not "
                                    f"{prompt!r}")
            d = _displacement(v)
            dx, dy = DIRECTIONS[motion]
            out.append(0.0 if d is None else float(d[0] / v.shape[-1] * dx + d[1] / v.shape[-2] * dy))
        return {"world_motion": torch.tensor(out, dtype=torch.float32, device=videos.device)}


@register_reward("world_caption")
def build_world_caption(**_: object) -> WorldCaptionReward:
    """Builder for the caption-agreement reward (ignores model options)."""
    return WorldCaptionReward()


@register_reward("world_size")
def build_world_size(**_: object) -> WorldSizeReward:
    """Builder for the object-size reward."""
    return WorldSizeReward()


@register_reward("world_color_share")
def build_world_color_share(world_color: str = "red", **_: object) -> WorldColorShareReward:
    """Builder for the named-colour-share reward (``world_color``: the colour name)."""
    return WorldColorShareReward(world_color)


@register_reward("world_motion_right")
def build_world_motion_right(**_: object) -> WorldMotionRightReward:
    """Builder for the motion-to-the-right reward."""
    return WorldMotionRightReward()


@register_reward("world_motion")
def build_world_motion(**_: object) -> WorldMotionReward:
    """Builder for the motion-along-the-caption reward."""
    return WorldMotionReward()
