"""PPO-style clipped surrogate of GRPO (paper Eq. 43; docs/algorithm.md "The rest of the algorithm").

Per (sample i, step t), ratio = exp(logp_new - logp_old):
    L(i, t) = max(-A_i * ratio, -A_i * clip(ratio, 1 - eps, 1 + eps))
weighted by the equalizer S_t of the step and averaged over the valid entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PolicyLossStats", "clipped_policy_loss"]


@dataclass
class PolicyLossStats:
    """Detached statistics of one policy-loss evaluation (floats, for logging)."""

    policy_loss: float
    clipfrac: float  # fraction of entries whose ratio left [1 - eps, 1 + eps]
    approx_kl: float  # 0.5 * mean((logp_new - logp_old)^2), as FlowGRPO logs it
    ratio_mean: float
    ratio_min: float
    ratio_max: float


def clipped_policy_loss(
    logp_new: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    clip_range: float,
    *,
    weights: Tensor | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, PolicyLossStats]:
    """Clipped surrogate -> (scalar loss to minimise, stats).

    logp_new, logp_old, advantages, weights (S_t), mask: broadcastable to one shape, e.g. [B] for a batch of
    (sample, step) pairs. `mask` False drops entries (failed rewards) from the loss and the statistics; an all-False
    mask gives a zero loss that still carries the graph.
    """
    shape = torch.broadcast_shapes(logp_new.shape, logp_old.shape, advantages.shape,
                                   *(() if weights is None else (weights.shape,)),
                                   *(() if mask is None else (mask.shape,)))
    m = torch.ones(shape, dtype=torch.bool, device=logp_new.device) if mask is None else mask.bool().expand(shape)
    # Dropped entries are zeroed *before* any arithmetic: a NaN advantage or an overflowing ratio there would
    # otherwise reach the loss and every gradient through NaN * 0 = NaN.
    log_ratio = torch.where(m, (logp_new - logp_old.detach()).expand(shape), 0.0)  # [B]
    ratio = torch.exp(log_ratio)
    adv = torch.where(m, advantages.detach().expand(shape), 0.0)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_entry = torch.maximum(unclipped, clipped)  # [B]
    if weights is not None:
        per_entry = per_entry * torch.where(m, weights.detach().expand(shape), 0.0)
    count = m.sum()
    loss = per_entry.sum() / count.clamp(min=1)
    with torch.no_grad():
        n = max(int(count.item()), 1)
        r = ratio.detach()[m] if bool(m.any()) else torch.ones(1, dtype=ratio.dtype, device=ratio.device)
        lr = log_ratio.detach()[m]
        stats = PolicyLossStats(
            policy_loss=float(loss.detach()),
            clipfrac=float(((r - 1.0).abs() > clip_range).float().sum()) / n if bool(m.any()) else 0.0,
            approx_kl=float(0.5 * (lr**2).sum()) / n,
            ratio_mean=float(r.mean()),
            ratio_min=float(r.min()),
            ratio_max=float(r.max()),
        )
    return loss, stats
