"""Sigma schedule of the GRPO rollouts and the choice of trained timesteps.

Rectified flow runs sigma from 1 (noise) to 0 (data). The HunyuanVideo-1.5 pipeline (diffusers'
FlowMatchEulerDiscreteScheduler with `shift`) uses u_i = 1 - i/T and sigma_i = s*u_i / (1 + (s - 1)*u_i);
tests/test_schedule.py checks the T = 20, s = 5 values; docs/algorithm.md "The samplers" gives the formulas.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["sigma_schedule", "num_train_timesteps", "select_timesteps", "timesteps_from_sigmas"]


def sigma_schedule(num_steps: int, shift: float = 5.0) -> Tensor:
    """Shifted flow-matching schedule -> Tensor[num_steps + 1] (fp64), sigma_0 = 1 ... sigma_T = 0."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    u = 1.0 - torch.arange(num_steps + 1, dtype=torch.float64) / num_steps  # [T+1], 1 -> 0
    return shift * u / (1.0 + (shift - 1.0) * u)


def timesteps_from_sigmas(sigmas: Tensor) -> Tensor:
    """Timesteps given to the HunyuanVideo-1.5 transformer: t = 1000 * sigma (floats)."""
    return sigmas * 1000.0


def num_train_timesteps(num_steps: int, timestep_fraction: float) -> int:
    """How many of the T steps are trained per sample: int(T * timestep_fraction), as the authors' code takes it
    (0.33 of 20 trains 6 steps). A fraction that trains no step is refused."""
    if not 0.0 < timestep_fraction <= 1.0:
        raise ValueError(f"timestep_fraction must be in (0, 1], got {timestep_fraction}")
    # round() first so that 0.3 * 10 = 2.9999999999999996-style products do not lose a step
    k = math.floor(round(num_steps * timestep_fraction, 9))
    if k < 1:
        raise ValueError(f"timestep_fraction {timestep_fraction:g} of {num_steps} steps trains no step "
                         f"(int({num_steps} x {timestep_fraction:g}) = 0); use at least {1 / num_steps:.4g}")
    return k


def select_timesteps(
    num_steps: int,
    timestep_fraction: float = 1.0,
    permute: bool = True,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Original diffusion indices of the steps to train -> LongTensor[k], k = int(T * fraction).

    With `permute` the steps are a random permutation (drawn from `generator`) cut to k; without it they are the
    first k steps in sampling order (the identity permutation).
    """
    k = num_train_timesteps(num_steps, timestep_fraction)
    order = torch.randperm(num_steps, generator=generator) if permute else torch.arange(num_steps)
    return order[:k]
