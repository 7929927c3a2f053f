"""Closed-form demo rewards that need no weights.

These exist so that the embedded tiny training demo and the tests have a reward whose optimisation a person can
*see* in the videos (brighter, redder, steadier). They are not quality metrics and say nothing about realism.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.rewards.base import register_reward

# ITU-R BT.601 luma weights: the usual "perceived brightness" of an RGB pixel
_LUMA = (0.299, 0.587, 0.114)


def _check_videos(videos: torch.Tensor) -> None:
    """Raise ValueError unless ``videos`` is float [B, F, 3, H, W]."""
    if videos.ndim != 5 or videos.shape[2] != 3 or not videos.is_floating_point():
        raise ValueError(f"expected float videos [B, F, 3, H, W] in [0, 1], got {tuple(videos.shape)} {videos.dtype}")


class BrightnessReward:
    """Mean BT.601 luma of all pixels of all frames, in [0, 1] (higher = brighter video)."""

    components = ("brightness",)
    default_weights = {"brightness": 1.0}

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score [B, F, 3, H, W] -> {"brightness": [B]}."""
        _check_videos(videos)
        w = torch.tensor(_LUMA, dtype=videos.dtype, device=videos.device).view(1, 1, 3, 1, 1)
        luma = (videos.clamp(0, 1) * w).sum(dim=2)  # [B, F, H, W]
        return {"brightness": luma.mean(dim=(1, 2, 3))}


class ColorReward:
    """Closeness of every pixel to a target RGB colour: ``1 - mean ||rgb - target||_2 / sqrt(3)`` in [0, 1].

    1 means every pixel is exactly the target colour. The default target is a saturated red, far from the grey
    mush a random tiny policy produces, so a few GRPO steps visibly tint the videos.
    """

    components = ("color",)
    default_weights = {"color": 1.0}

    def __init__(self, target: Sequence[float] = (1.0, 0.1, 0.1)):
        """``target``: RGB in [0, 1]."""
        if len(target) != 3 or not all(0.0 <= float(t) <= 1.0 for t in target):
            raise SageGRPOError(f"color reward target must be 3 numbers in [0, 1] (R, G, B), got {target!r}")
        self.target = tuple(float(t) for t in target)

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score [B, F, 3, H, W] -> {"color": [B]}."""
        _check_videos(videos)
        t = torch.tensor(self.target, dtype=videos.dtype, device=videos.device).view(1, 1, 3, 1, 1)
        dist = (videos.clamp(0, 1) - t).pow(2).sum(dim=2).sqrt()  # [B, F, H, W], in [0, sqrt(3)]
        return {"color": 1.0 - dist.mean(dim=(1, 2, 3)) / 3**0.5}


class TemporalConsistencyReward:
    """``-mean |frame_{t+1} - frame_t|`` over pixels and channels, in [-1, 0] (0 = perfectly still video).

    A flicker penalty: it rewards steady videos, including boringly static ones, so use it only as a demo or as a
    small regulariser beside a real reward. A single-frame video scores 0.
    """

    components = ("temporal_consistency",)
    default_weights = {"temporal_consistency": 1.0}

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score [B, F, 3, H, W] -> {"temporal_consistency": [B]}."""
        _check_videos(videos)
        if videos.shape[1] < 2:
            return {"temporal_consistency": torch.zeros(videos.shape[0], dtype=videos.dtype, device=videos.device)}
        diff = (videos[:, 1:] - videos[:, :-1]).abs()  # [B, F-1, 3, H, W]
        return {"temporal_consistency": -diff.mean(dim=(1, 2, 3, 4))}


@register_reward("brightness")
def build_brightness(**_: object) -> BrightnessReward:
    """Builder for the brightness demo reward (ignores model options)."""
    return BrightnessReward()


@register_reward("color")
def build_color(color_target: Sequence[float] = (1.0, 0.1, 0.1), **_: object) -> ColorReward:
    """Builder for the colour-target demo reward."""
    return ColorReward(color_target)


@register_reward("temporal_consistency")
def build_temporal_consistency(**_: object) -> TemporalConsistencyReward:
    """Builder for the frame-difference demo reward."""
    return TemporalConsistencyReward()
