"""Gradient-norm equalizer (paper Eq. 8-9, App. A.5; docs/algorithm.md "The rest of the algorithm").

For a Gaussian step ||d log pi / d mean|| ~ 1 / sqrt(V_t), and the network output enters the mean with
sensitivity |d mean / d v|, so the gradient scale of step t is N_t = |d mean_t / d v| / sqrt(V_t). The weight
S_t = median(N) / (N_t + eps) brings every step to the median scale. S depends on the schedule only (no data).

cps with the peers' log-prob (-(x' - mean)^2, `cps_logprob="peer"`, the default) is not a Gaussian density: its
gradient is 2 (x' - mean) * d mean / d v = 2 s_t xi * d mean / d v, so its scale is N_t = |d mean / d v| * sqrt(V_t).
Using the Gaussian proxy there would *widen* the spread of gradient norms across steps instead of narrowing it
(measured in the lab: 0.6 -> 1.9 orders of magnitude), so the proxy follows the log-prob actually used.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .sde import CPS_LOGPROB_MODES, SAGE_SIGMA_CLAMP, mean_sensitivity, step_variance

__all__ = ["gradient_scale", "equalizer_weights"]


def gradient_scale(
    sde_type: str,
    sigmas: Tensor,
    eta: float,
    *,
    cps_logprob: str = "peer",
    sage_clamp: float = SAGE_SIGMA_CLAMP,
) -> Tensor:
    """N_t for every step of the schedule -> Tensor[T] (fp64). sigmas: [T + 1], 1 -> 0.

    Guards: V_t <= 0 or sigma_t = 0 -> N_t = 1; a non-finite or non-positive N_t -> 1.
    """
    if cps_logprob not in CPS_LOGPROB_MODES:
        raise ValueError(f"cps_logprob must be one of {CPS_LOGPROB_MODES}, got {cps_logprob!r}")
    sigmas = torch.as_tensor(sigmas, dtype=torch.float64)
    sigma, sigma_next = sigmas[:-1], sigmas[1:]  # [T]
    var = step_variance(sde_type, sigma, sigma_next, eta, sigma_max=sigmas[1], sage_clamp=sage_clamp)  # [T]
    sens = mean_sensitivity(sde_type, sigma, sigma_next, var).abs()  # [T]
    ok = (var > 0) & (sigma > 0)
    std = var.clamp(min=1e-300).sqrt()
    scale = sens * std if (sde_type == "cps" and cps_logprob == "peer") else sens / std
    n = torch.where(ok, scale, torch.ones_like(var))
    return torch.where(torch.isfinite(n) & (n > 0), n, torch.ones_like(n))


def equalizer_weights(
    sde_type: str,
    sigmas: Tensor,
    eta: float,
    *,
    eps: float = 1e-8,
    cps_logprob: str = "peer",
    sage_clamp: float = SAGE_SIGMA_CLAMP,
    steps: Tensor | None = None,
) -> Tensor:
    """S_t = median_tau(N_tau) / (N_t + eps) -> Tensor[T] (fp32), indexed by the original diffusion step.

    The median of an even count is the lower middle value (torch.median), as in the authors' code. steps: [T]
    bool, the steps the median runs over: an SDE window's (only they are trained, so they are brought to their own
    median); None = every step.
    """
    n = gradient_scale(sde_type, sigmas, eta, cps_logprob=cps_logprob, sage_clamp=sage_clamp)
    over = n if steps is None else n[torch.as_tensor(steps, dtype=torch.bool)]
    return (torch.median(over) / (n + eps)).float()
