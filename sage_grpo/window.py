"""SDE windows (MixGRPO, Li et al. 2025): SDE steps only inside a window of the schedule, ODE steps outside.

A rollout of T steps runs the SDE (noise injected, log-prob recorded, trainable) at the diffusion indices
[lo, hi) of its window and deterministic Euler ODE steps elsewhere; only window steps are trained, and the
gradient-norm equalizer normalises over them. The paper's recipe is the window [0, T) (every step SDE).

A fixed window is (start, size). A sliding window moves `stride` steps later every `every` optimizer updates; when
it would run past the last step it starts again at `start` (MixGRPO's `--roll_back`, which its scripts use), and
the window is always whole (MixGRPO shortens the last one). Its position is a pure function of the update count,
which the train state saves, so a resumed run takes the same windows as an uninterrupted one.

With one initial noise per group (`--use_same_noise`) the G samples of a prompt are identical until the window
starts: the ODE prefix [0, lo) is the same for all of them and `sage_grpo.rollout` computes it once per prompt.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["window_bounds", "window_index", "window_positions", "window_mask", "window_masks", "prefix_steps"]


def window_positions(num_steps: int, start: int, size: int, stride: int) -> list[int]:
    """Every first step the window takes, in order -> [start, start + stride, ...] while the window fits in
    [0, num_steps). size 0 = to the end of the schedule (fixed); stride 0 = a fixed window."""
    size = size or num_steps - start
    if not 0 <= start < num_steps or size < 1 or start + size > num_steps:
        raise ValueError(f"the SDE window [{start}, {start + size}) is not inside the {num_steps} steps")
    if stride == 0:
        return [start]
    return list(range(start, num_steps - size + 1, stride))


def window_index(num_positions: int, every: int, update: int) -> int:
    """Which of the window's positions the rollout after `update` optimizer updates takes: the next one every
    `every` updates, back to the first after the last."""
    return (update // every) % num_positions


def window_bounds(num_steps: int, start: int, size: int, stride: int, every: int, update: int) -> tuple[int, int]:
    """The window [lo, hi) of the rollout taken after `update` optimizer updates."""
    positions = window_positions(num_steps, start, size, stride)
    lo = positions[window_index(len(positions), every, update)]
    return lo, lo + (size or num_steps - start)


def window_mask(num_steps: int, lo: int, hi: int) -> Tensor:
    """[T] bool: True at the SDE steps [lo, hi)."""
    steps = torch.arange(num_steps)
    return (steps >= lo) & (steps < hi)


def window_masks(num_steps: int, start: int, size: int, stride: int) -> Tensor:
    """[P, T] bool: the SDE steps of each of the window's P positions (P = 1 for a fixed window)."""
    size = size or num_steps - start
    return torch.stack([window_mask(num_steps, lo, lo + size)
                        for lo in window_positions(num_steps, start, size, stride)])


def prefix_steps(sde_steps: Tensor) -> int:
    """The number of leading ODE steps of a mask [T] (the steps a group shares under one initial noise)."""
    sde = torch.as_tensor(sde_steps, dtype=torch.bool)
    return int(sde.int().argmax()) if sde.any() else int(sde.numel())
