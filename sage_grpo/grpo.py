"""One GRPO policy update over a rollout batch: the code shared by post_train.py and the CPU lab.

Given a rollout (stored x_0..x_T, per-step log-probs), advantages and a step callback that re-runs the policy on
stored transitions, an update

1. plans the trained (sample, step) pairs: each sample trains int(T' * timestep_fraction) of the T' steps that
   inject noise (a step with V_t = 0, cps's last, has no policy gradient and its KL_pos would divide by the 1e-6
   guard, so it is removed *before* the selection), permuted per sample or in sampling order;
2. groups the pairs into micro-batches (the caller decides the composition: the video loop re-scores in the
   rollout's chunks so that the first ratio is exactly 1, the lab takes all pairs at once);
3. per micro-batch: re-scores the stored x_{t+1} through the callback (with grad), forms the ratio and the clipped
   surrogate times the equalizer S_t at the step's original index, adds lambda_KL * (beta_pos KL_pos + beta_vel
   KL_vel), and backpropagates the *sum* over its valid pairs divided by `normalizer` (the number of trained pairs
   the gradient averages over: the whole optimizer update's in the lab; post_train.py, which learns the pair count
   of each accumulated round only when it runs, passes the pairs so far and rescales the gradient already there),
   so the accumulated gradient is the mean over pairs whatever the micro-batch size.

The optimizer step, the anchor refresh and the KL controller belong to the callers (their cadence differs: the
video loop may accumulate several rollout rounds per update).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .kl import dual_kl, kl_position, kl_velocity
from .loss import clipped_policy_loss
from .schedule import num_train_timesteps
from .sde import SDEStepOutput

__all__ = ["PairBatch", "UpdateStats", "stochastic_steps", "plan_generators", "plan_steps", "update_chunks",
           "micro_batches", "grpo_backward"]


def stochastic_steps(variance: Tensor) -> Tensor:
    """Diffusion indices of the steps that inject noise (V_t > 0) -> LongTensor[T']. variance: [T]."""
    return torch.nonzero(torch.as_tensor(variance) > 0).flatten()


def plan_generators(seed: int, step: int, first: int, num_samples: int, group_size: int = 1) -> list[torch.Generator]:
    """The generators that draw the trained steps of a rank's samples: video first + i of the step's global batch
    seeded by (seed, step, video), or, with group_size G (Flash-GRPO's one timestep per group), by (seed, step,
    group) with group = video // G, the step's layout [p0 x G, p1 x G, ...] (sage_grpo.data.GroupSampler), so the G
    samples of a group draw the same steps on any number of ranks."""
    from sage_grpo.seeding import derive_seed

    return [torch.Generator().manual_seed(derive_seed(seed, step, (first + i) // group_size, 0x7E5))
            for i in range(num_samples)]


def plan_steps(
    num_samples: int,
    variance: Tensor,
    timestep_fraction: float,
    permute: bool,
    generators: torch.Generator | Sequence[torch.Generator] | None = None,
) -> Tensor:
    """Trained steps of every sample -> LongTensor[B, k] of original diffusion indices, k = int(T' * fraction)
    over the T' stochastic steps. With `permute` each sample draws its own order (from its generator, or all from
    one shared generator); without it the first k stochastic steps in sampling order."""
    steps = stochastic_steps(variance)  # [T']
    if steps.numel() == 0:
        raise ValueError("no step of this schedule injects noise: nothing to train (eta = 0?)")
    k = num_train_timesteps(int(steps.numel()), timestep_fraction)
    if not permute:
        return steps[:k].expand(num_samples, k).clone()
    if generators is None or isinstance(generators, torch.Generator):
        gens = [generators] * num_samples
    else:
        gens = list(generators)
        if len(gens) != num_samples:
            raise ValueError(f"got {len(gens)} generators for {num_samples} samples")
    return torch.stack([steps[torch.randperm(steps.numel(), generator=g)[:k]] for g in gens])


@dataclass
class PairBatch:
    """One micro-batch of trained (sample, step) pairs. P = pairs."""

    samples: Tensor  # [P] long: index into the rollout batch
    steps: Tensor  # [P] long: original diffusion index of the transition x_t -> x_{t+1}
    ref_mean: Tensor | None = None  # [P, ...] anchor means when precomputed (kl_compute_mode rollout_phase)


def update_chunks(first: int, num_samples: int, chunk: int, updates: int) -> list[list[Tensor]]:
    """A rank's rollout chunks for each of a round's `updates` optimizer updates -> [update][chunk] LongTensors of
    indices into the rank's `num_samples` samples, whose global indices (in the step's batch over the data-parallel
    ranks) start at `first`. Chunk g of the global batch (global samples g*chunk .. (g+1)*chunk - 1) goes to update
    g % updates: by global index, so a round trains the same samples in each update on any number of ranks (a split
    of each rank's own chunks would train [[0,1,4,5],[2,3,6,7]] on 2 ranks of 4 and [[0,1,2,3],[4,5,6,7]] on one of
    8). Every rank's num_samples is a multiple of chunk x updates (config.validate), so each rank takes the same
    number of chunks in every update and the ranks run the same forwards and collectives."""
    if first % (chunk * updates) or num_samples % (chunk * updates):
        raise ValueError(f"{num_samples} samples from {first} do not split into {updates} updates of whole chunks of "
                         f"{chunk}")
    chunks = list(torch.arange(num_samples).split(chunk))  # the rollout's chunks, in the rank's order
    # first / chunk is a multiple of `updates`: the rank's chunk j is global chunk first / chunk + j, update j % updates
    return [chunks[u::updates] for u in range(updates)]


def micro_batches(steps: Tensor, chunks: Sequence[Tensor] | None = None) -> list[PairBatch]:
    """Micro-batches over a plan `steps` [B, k]: for each chunk of samples (default: all samples as one chunk) and
    each of the k positions j, the pairs (i, steps[i, j]) of the chunk's samples. With the rollout's chunks every
    micro-batch has the rollout's batch composition."""
    if chunks is None:
        chunks = [torch.arange(steps.shape[0])]
    return [PairBatch(samples=c, steps=steps[c, j]) for c in chunks for j in range(steps.shape[1])]


@dataclass
class UpdateStats:
    """Sums over the pairs of one or more micro-batches (turned into means by `summary`)."""

    pairs: int = 0  # valid (trained) pairs
    masked_pairs: int = 0  # pairs of samples whose reward failed (run with weight 0)
    sums: dict[str, float] = field(default_factory=dict)
    ratio_min: float = math.inf
    ratio_max: float = -math.inf

    def add(self, key: str, value: float, count: int) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value * count

    def merge(self, other: UpdateStats) -> None:
        self.pairs += other.pairs
        self.masked_pairs += other.masked_pairs
        for k, v in other.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        # a NaN ratio stays NaN: builtin min/max keep the first argument when a comparison with NaN is False
        nan = math.isnan(self.ratio_min) or math.isnan(other.ratio_min)
        self.ratio_min = math.nan if nan else min(self.ratio_min, other.ratio_min)
        nan = math.isnan(self.ratio_max) or math.isnan(other.ratio_max)
        self.ratio_max = math.nan if nan else max(self.ratio_max, other.ratio_max)

    def summary(self) -> dict[str, float]:
        """Per-pair means of the summed statistics, plus ratio extremes (nan when no pair was trained)."""
        n = max(self.pairs, 1)
        out = {k: v / n for k, v in self.sums.items()}
        out["train/ratio_min"] = self.ratio_min if self.pairs else math.nan
        out["train/ratio_max"] = self.ratio_max if self.pairs else math.nan
        return out


def grpo_backward(
    batch: PairBatch,
    step_fn: Callable[[Tensor, Tensor], SDEStepOutput],
    *,
    logp_old: Tensor,
    advantages: Tensor,
    valid: Tensor,
    step_weights: Tensor,
    clip_range: float,
    normalizer: float,
    kl_coef: float = 0.0,
    beta_pos: float = 0.0,
    beta_vel: float = 0.0,
    anchor_fn: Callable[[PairBatch], Tensor] | None = None,
    anchor_is_policy: bool = False,
) -> UpdateStats:
    """Re-score one micro-batch with grad, backpropagate its share of the GRPO loss, return its statistics.

    step_fn(samples [P], steps [P]) -> SDEStepOutput of the policy on the stored transitions (log_prob [P],
    mean [P, ...], std [P]). logp_old: [B, T] rollout log-probs; advantages: [B]; valid: [B] bool (False = failed
    reward: the sample's pairs still run, every rank does the same forwards, with weight 0); step_weights: [T]
    S_t (ones without the equalizer). normalizer: the trained pairs the gradient averages over (> 0).
    KL_pos (beta_pos > 0) needs the anchor's means: `batch.ref_mean`, else `anchor_fn(batch)`; with
    `anchor_is_policy` (the anchor equals the policy that made the rollout and no optimizer step has happened
    since) the policy's own detached means stand in, giving KL_pos = 0 and zero gradient without a forward.
    """
    i, t = batch.samples, batch.steps
    ref = None
    if beta_pos > 0 and not anchor_is_policy:
        # the anchor runs first: a LoRA anchor swaps adapter weights in place, which must not happen while the
        # policy's graph holds them for backward
        if batch.ref_mean is not None:
            ref = batch.ref_mean
        elif anchor_fn is not None:
            with torch.no_grad():
                ref = anchor_fn(batch)
        else:
            raise ValueError("KL_pos needs the anchor means (batch.ref_mean or anchor_fn)")
    out = step_fn(i, t)
    dev = out.log_prob.device
    i_d, t_d = i.to(logp_old.device), t.to(logp_old.device)
    lp_old = logp_old[i_d, t_d].to(dev)  # [P]
    adv = advantages[i.to(advantages.device)].to(dev)  # [P]
    mask = valid[i.to(valid.device)].to(dev)  # [P]
    weights = step_weights.to(dev)[t.to(dev)]  # [P]
    count = int(mask.sum())
    pg_loss, pstats = clipped_policy_loss(out.log_prob, lp_old, adv, clip_range, weights=weights, mask=mask)
    loss = pg_loss * count  # sum over the valid pairs
    stats = UpdateStats(pairs=count, masked_pairs=int(mask.numel()) - count)
    stats.add("train/policy_loss", pstats.policy_loss, count)
    stats.add("train/clipfrac", pstats.clipfrac, count)
    stats.add("train/approx_kl", pstats.approx_kl, count)
    stats.add("train/ratio_mean", pstats.ratio_mean, count)
    if count:
        stats.ratio_min, stats.ratio_max = pstats.ratio_min, pstats.ratio_max
    m = mask.float()
    kl_pos = kl_vel = None  # [P] per pair, 0 on masked pairs
    if beta_pos > 0:
        if anchor_is_policy:
            ref = out.mean.detach()
        kl_pos = torch.where(mask, kl_position(out.mean, ref.to(dev), out.std**2), 0.0)
        stats.add("kl/pos", float(kl_pos.detach().sum()) / max(count, 1), count)
    if beta_vel > 0:
        kl_vel = torch.where(mask, kl_velocity(lp_old, out.log_prob), 0.0)
        stats.add("kl/vel", float(kl_vel.detach().sum()) / max(count, 1), count)
    if kl_pos is not None or kl_vel is not None:
        kl_total = dual_kl(kl_pos, kl_vel, beta_pos=beta_pos, beta_vel=beta_vel, reduction="sum")  # sum over pairs
        stats.add("kl/loss", float(kl_total.detach()) / max(count, 1), count)
        loss = loss + kl_coef * kl_total
    (loss * m.new_tensor(1.0 / normalizer)).backward()
    stats.add("train/loss", float(loss.detach()) / max(count, 1), count)
    return stats
