"""Group-relative advantages (paper Eq. 10, 34-35; docs/algorithm.md "The rest of the algorithm").

A_i = (r_i - mean_G) / (std_G + eps) with the population std over the group. Failed rewards (NaN/inf) are masked
out of the group statistics and out of the loss instead of being replaced by 0, which would shift the group mean
and silently bias every other sample. A constant group (or a group with fewer than two valid rewards) gives A = 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["combine_components", "group_advantages"]


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
        if _constant(rg):  # constant up to float32 rounding: zero, not (r - mean) / (std + eps) of rounding noise
            continue
        mean = rg.mean()
        std = rg.std(unbiased=False)  # population std
        adv[member] = (rg - mean) / (std + eps)
    adv = adv.clamp(-adv_clip_max, adv_clip_max)
    return adv.float(), valid


# A component whose spread within a group is at most this many float32 epsilons of its largest magnitude counts as
# constant in component_norm. The scores arrive as float32 (post_train.score_videos), so the same video scored in
# another batch composition or kernel order can differ by rounding: one ulp (eps/2..eps relative) and, after a
# float32 reduction over n terms, up to about log2(n) ulps (16 covers 65k terms). Normalising that spread would blow
# it up to |z| ~ 1, as large as a real difference. 16 eps = 1.9e-6 relative; a real difference of 1e-4 relative
# (~840 ulps) is still normalised, even in one video of a group of up to 500 (its std ~ 1e-4 / sqrt(G)). The scale
# is max |x| rather than |mean|: a component centred on 0 (a signed score) would otherwise get no floor at all.
CONSTANT_SPREAD_EPS = 16 * torch.finfo(torch.float32).eps


def _constant(x: Tensor) -> bool:
    """x [m] (m >= 2) is one value up to float32 rounding: population std <= CONSTANT_SPREAD_EPS * max |x|."""
    return bool(x.std(unbiased=False) <= CONSTANT_SPREAD_EPS * x.abs().max())


def combine_components(
    scores: Tensor,
    weights: Tensor,
    required: Tensor,
    group_ids: Tensor,
    *,
    normalize: bool,
    eps: float = 1e-8,
) -> Tensor:
    """The per-sample training reward from the reward components, for `group_advantages` (docs/rewards.md).

    scores: [N, K] component scores, NaN/inf where a score failed; weights: [K] (0 = not trained); required: [K]
    bool (False = optional); group_ids: [N]. A sample is masked (NaN) when a required weighted component failed or
    every weighted component failed. Within each group, over its unmasked samples that have component k:
    normalize=False: s_i = sum_k w_k r_ik, a failed optional r_ik replaced by the group's mean of component k (so it
    moves the sample neither up nor down on k; 0 when no sample of the group has it: a constant, which the group
    advantage cancels); normalize=True (GDPO-style): s_i = sum_k w_k z_ik with z_ik = (r_ik - mean) / (std + eps),
    population std, z = 0 for a failed optional score and for a component that is constant in the group up to
    float32 rounding (population std <= CONSTANT_SPREAD_EPS * max |r|; one sample is constant). Returns s [N]
    float64, NaN at masked samples.
    """
    if scores.ndim != 2 or weights.shape != (scores.shape[1],) or required.shape != weights.shape \
            or group_ids.shape != (scores.shape[0],):
        raise ValueError(f"scores {tuple(scores.shape)}, weights {tuple(weights.shape)}, required "
                         f"{tuple(required.shape)} and group_ids {tuple(group_ids.shape)} do not match")
    s, w = scores.double(), weights.double()
    used = w != 0  # [K]
    ok = torch.isfinite(s)  # [N, K]
    # masked: a required weighted component failed, or nothing weighted is left
    valid = (ok | ~(used & required)).all(dim=1) & (ok & used).any(dim=1)  # [N]
    out = torch.full(s.shape[:1], float("nan"), dtype=torch.float64)
    for g in torch.unique(group_ids):
        rows = (group_ids == g) & valid  # [N]
        if not bool(rows.any()):
            continue
        total = torch.zeros(int(rows.sum()), dtype=torch.float64)  # [n_g]
        for k in used.nonzero().flatten().tolist():
            col, have = s[rows, k], ok[rows, k]  # [n_g]
            x = col[have]  # [m]
            term = torch.zeros_like(col)
            if normalize:
                if x.numel() >= 2 and not _constant(x):  # a constant: 0, not rounding noise / (std + eps)
                    term[have] = (x - x.mean()) / (x.std(unbiased=False) + eps)
            elif x.numel():
                term = torch.where(have, col, x.mean())
            total = total + w[k] * term
        out[rows] = total
    return out
