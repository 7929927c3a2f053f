"""SDE windows (MixGRPO, Li et al. 2025): SDE steps only inside a window of the schedule, ODE steps outside.

A rollout of T steps runs the SDE (noise injected, log-prob recorded, trainable) at the diffusion indices
[lo, hi) of its window and deterministic Euler ODE steps elsewhere; only window steps are trained, and the
gradient-norm equalizer normalises over them. The paper's recipe is the window [0, T) (every step SDE).

A fixed window is (start, size). A sliding window moves `stride` steps later every `every` optimizer updates; when
it would run past the last step it starts again at `start` (MixGRPO's `--roll_back`, which its scripts use), and
the window is always whole (MixGRPO shortens the last one). Its position is a pure function of the update count,
which the train state saves, so a resumed run takes the same windows as an uninterrupted one.

The ODE after the window (the tail [hi, T)) decides nothing that is trained, only the video that is scored: with
`--ode_steps n` it takes n steps evenly spaced in sigma (`tail_sigmas`), with `--ode_solver unipc`
a second-order solver, so that fewer steps reach the same end point.

With one initial noise per group (`--use_same_noise`) the G samples of a prompt are identical until the window
starts: the ODE prefix [0, lo) is the same for all of them and `sage_grpo.rollout` computes it once per prompt.
"""

from __future__ import annotations

import torch
from torch import Tensor

ODE_SOLVERS = ("euler", "unipc")  # --ode_solver: the solvers of the ODE tail (sage_grpo.rollout.ode_tail)

__all__ = ["ODE_SOLVERS", "window_bounds", "window_index", "window_positions", "window_mask", "window_masks",
           "prefix_steps", "tail_start", "tail_steps", "tail_sigmas"]


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


def tail_start(sde_steps: Tensor) -> int:
    """The first step of the ODE tail of a mask [T]: one past its last SDE step (T when the window reaches the end;
    0 with no SDE step at all)."""
    sde = torch.as_tensor(sde_steps, dtype=torch.bool)
    return int(torch.nonzero(sde).max()) + 1 if sde.any() else 0



def tail_steps(hi: int, num_steps: int, ode_steps: int) -> int:
    """Solver steps of the ODE tail [hi, T) under --ode_steps: the schedule's T - hi when ode_steps is 0 or not
    fewer."""
    n = num_steps - hi
    return n if ode_steps <= 0 else min(n, ode_steps)


def tail_sigmas(sigmas: Tensor, hi: int, ode_steps: int) -> Tensor:
    """The sigmas [n + 1] the ODE tail visits from the window's end sigmas[hi] to 0: the schedule's own when
    ode_steps keeps every step, else n = ode_steps steps evenly spaced in sigma (the flow's time). Even spacing, not
    a subset of the shifted schedule: the shift crowds the steps at high noise, and a few steps over the tail then
    leave one long last step (on the tiny world model without CFG, 4 UniPC steps on this grid end 0.095 from a
    200-step reference, the schedule's 8 Euler steps 0.083, 4 Euler steps on this grid 0.135; 3 UniPC steps on the
    schedule's subset 0.22)."""
    t = sigmas.numel() - 1
    if tail_steps(hi, t, ode_steps) == t - hi:
        return sigmas[hi:]
    return torch.linspace(float(sigmas[hi]), 0.0, ode_steps + 1, dtype=sigmas.dtype, device=sigmas.device)
