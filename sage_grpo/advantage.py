"""Group-relative advantages (paper Eq. 10, 34-35; docs/algorithm.md "The rest of the algorithm").

A_i = (r_i - mean_G) / (std_G + eps) with the population std over the group. Failed rewards (NaN/inf) are masked
out of the group statistics and out of the loss instead of being replaced by 0, which would shift the group mean
and silently bias every other sample. A constant group (or a group with fewer than two valid rewards) gives A = 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["group_advantages"]


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    eps: float = 1e-8,
    adv_clip_max: float = 5.0,
) -> tuple[Tensor, Tensor]:
    """Advantages of all samples of a (gathered) batch.

    rewards: [N] composite rewards, NaN/inf for failed scores. group_ids: [N] ints, equal for the G rollouts of
    one prompt (a group may span data-parallel ranks: gather before calling).
    Returns (advantages [N] fp32 clamped to +-adv_clip_max with 0 at masked entries, valid [N] bool).
    """
    if rewards.shape != group_ids.shape or rewards.ndim != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D")
    r = rewards.double()
    valid = torch.isfinite(r)  # [N]
    adv = torch.zeros_like(r)
    for g in torch.unique(group_ids):
        member = (group_ids == g) & valid  # [N]
        if int(member.sum()) < 2:
            continue
        rg = r[member]  # [n_g]
        if bool((rg == rg[0]).all()):  # constant group: exactly zero, not (r - mean) / eps of rounding noise
            continue
        mean = rg.mean()
        std = rg.std(unbiased=False)  # population std
        adv[member] = (rg - mean) / (std + eps)
    adv = adv.clamp(-adv_clip_max, adv_clip_max)
    return adv.float(), valid
