"""Run metrics of the lab: sample quality against the known support, diversity, and per-step gradient norms.

All functions are pure (tensors in, numbers or tensors out); `per_step_grad_norms` differentiates the policy but
does not touch its `.grad` buffers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from ..sde import sde_step, step_variance
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
    sigmas: Tensor,
    *,
    sampler: str,
    eta: float,
    cps_logprob: str = "peer",
) -> Tensor:
    """RMS over samples of || d/d theta log pi(x_{t+1}^i | x_t^i) || for every step t -> Tensor[T] (fp64).

    The quantity of the paper's Eq. 8 / Fig. 4, measured on the parameters rather than on the mean: per-sample
    gradients (torch.func) avoid the cross-sample cancellation of a batch gradient, so the per-step value is stable
    with a few dozen rollouts. Multiply by S_t for the equalized norms (S_t is a per-step constant).
    latents: [T + 1, B, D] a stored rollout; sigmas: [T + 1]. Steps with no injected noise report 0.
    """
    params = {k: p.detach() for k, p in policy.named_parameters()}
    buffers = dict(policy.named_buffers())
    num_steps, batch = latents.shape[0] - 1, latents.shape[1]
    norms = torch.zeros(num_steps, dtype=torch.float64)
    for t in range(num_steps):
        s, s_next = float(sigmas[t]), float(sigmas[t + 1])
        if float(step_variance(sampler, sigmas[t], sigmas[t + 1], eta, sigma_max=sigmas[1])) <= 0:
            continue  # deterministic step: the log-prob does not depend on theta

        def log_prob_one(p: dict, x_t: Tensor, x_next: Tensor, s: float = s, s_next: float = s_next) -> Tensor:
            v = functional_call(policy, (p, buffers), (x_t[None], torch.full((1,), s)))  # [1, D]
            out = sde_step(
                sampler, v, x_t[None], s, s_next, eta, sigma_max=sigmas[1], prev_sample=x_next[None],
                cps_logprob=cps_logprob,
            )
            return out.log_prob[0]

        grads = vmap(grad(log_prob_one), in_dims=(None, 0, 0))(params, latents[t], latents[t + 1])  # {k: [B, ...]}
        sq = sum((g.double().reshape(batch, -1) ** 2).sum(dim=1) for g in grads.values())  # [B]
        norms[t] = float(sq.mean().sqrt())
    return norms


def log_spread(values: Tensor) -> float:
    """Spread of positive per-step values in orders of magnitude: log10(max / min) over the entries > 0."""
    pos = values[values > 0].double()
    if pos.numel() < 2:
        return 0.0
    return float(torch.log10(pos.max() / pos.min()))
