"""Run metrics of the lab: sample quality against the known support, diversity, and per-step gradient norms.

All functions are pure (tensors in, numbers or tensors out); `per_step_grad_norms` differentiates the policy but
does not touch its `.grad` buffers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..sde import sde_step
from .data import RingManifold

__all__ = ["sample_metrics", "per_step_grad_norms", "log_spread"]

# A mode counts as covered when it holds at least this fraction of the samples (uniform = 1/K = 12.5% for K = 8).
MODE_COVERAGE_MIN_FRACTION = 0.01


def sample_metrics(data: RingManifold, x: Tensor) -> dict[str, float]:
    """Quality and diversity of samples x [n, D] -> {reward, off_manifold, off_manifold_p90, mode_coverage,
    mode_entropy, target_mode_frac}.

    off_manifold: mean distance to the circle (0 on the data). mode_coverage: fraction of the K modes holding at
    least MODE_COVERAGE_MIN_FRACTION of the samples. mode_entropy: entropy of the mode histogram / log K, 1 for
    the uniform data distribution, 0 when everything collapsed into one mode.
    """
    dist = data.distance_to_support(x)  # [n]
    frac = torch.bincount(data.assign_modes(x), minlength=data.num_modes).double() / x.shape[0]  # [K]
    nz = frac[frac > 0]
    entropy = float(-(nz * nz.log()).sum()) / math.log(data.num_modes) if data.num_modes > 1 else 0.0
    return {
        "reward": float(data.reward(x).mean()),
        "off_manifold": float(dist.mean()),
        "off_manifold_p90": float(torch.quantile(dist, 0.9)),
        "mode_coverage": float((frac >= MODE_COVERAGE_MIN_FRACTION).double().mean()),
        "mode_entropy": entropy,
        "target_mode_frac": float(frac[data.target_mode]),
    }


def per_step_grad_norms(
    policy: nn.Module,
    latents: Tensor,
    advantages: Tensor,
    sigmas: Tensor,
    *,
    sampler: str,
    eta: float,
    cps_logprob: str = "peer",
) -> Tensor:
    """|| d/d theta mean_i(A_i * log pi(x_{t+1}^i | x_t^i)) || for every step t -> Tensor[T] (fp64).

    This is the policy-gradient of one step of one rollout batch, before any equalizer weight; multiplying by S_t
    gives the equalized norms (S_t is a per-step constant). latents: [T + 1, B, D] stored rollout, advantages: [B],
    sigmas: [T + 1]. Steps with no injected noise have a zero log-prob gradient and report 0.
    """
    params = [p for p in policy.parameters() if p.requires_grad]
    num_steps = latents.shape[0] - 1
    norms = torch.zeros(num_steps, dtype=torch.float64)
    for t in range(num_steps):
        x_t, x_next = latents[t], latents[t + 1]  # [B, D]
        s, s_next = float(sigmas[t]), float(sigmas[t + 1])
        v = policy(x_t, torch.full((x_t.shape[0],), s))  # [B, D]
        out = sde_step(
            sampler, v, x_t, s, s_next, eta, sigma_max=sigmas[1], prev_sample=x_next, cps_logprob=cps_logprob
        )
        objective = (advantages * out.log_prob).mean()
        if not objective.requires_grad:  # deterministic step: the log-prob does not depend on theta
            continue
        grads = torch.autograd.grad(objective, params, allow_unused=True)
        norms[t] = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads if g is not None))
    return norms


def log_spread(values: Tensor) -> float:
    """Spread of positive per-step values in orders of magnitude: log10(max / min) over the entries > 0."""
    pos = values[values > 0].double()
    if pos.numel() < 2:
        return 0.0
    return float(torch.log10(pos.max() / pos.min()))
