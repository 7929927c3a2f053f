"""GRPO post-training of the toy flow with the package's math core (the same functions the video loop uses).

One iteration = one rollout batch:
1. rollout (no grad): num_groups x group_size samples from independent initial noise, T SDE steps of the chosen
   sampler, storing x_0..x_T and the per-step log-probs;
2. reward of the final samples, group-relative advantages (`group_advantages`);
3. `updates_per_rollout` optimizer updates, each on a disjoint minibatch of samples, through the GRPO update that
   post_train.py uses (`sage_grpo.grpo`: `plan_steps` picks int(T' * timestep_fraction) stochastic steps per sample,
   `grpo_backward` re-scores the stored x_{t+1}, weights the clipped surrogate by the equalizer S_t and adds
   lambda_KL * L_KL), so every lab result speaks for the video loop.

KL variants (docs/algorithm.md "The rest of the algorithm"; `sage_grpo.kl.KL_VARIANTS`):
    none        no KL term
    fixed       KL_pos to the initial model (anchor never refreshed)
    moving      KL_pos to an anchor copied from the policy every `kl_refresh_every` optimizer updates
    stepwise    KL_vel only (k1 estimate against the rollout policy), with weight `kl_stepwise_beta_vel`
    dual        moving KL_pos + kl_beta_vel * KL_vel (the paper's dual trust region)
    dual_fixed  fixed KL_pos + kl_beta_vel * KL_vel

Steps whose injected variance is 0 (the last cps step) carry no policy gradient and would make KL_pos blow up
through the 1e-6 variance guard, so the lab never trains them.

Toy-scale defaults (why they differ from the video peers): the peers' clip range 1e-4 and lambda_KL in
[1e-7, 1e-5] fit log-probs averaged over ~10^5-10^6 latent elements; here a log-prob averages 2-16 elements, so
the per-update log-ratio is O(1e-3..1e-2) and KL_pos is O(1e-4..1e-2). Hence clip_range 0.01 (about 1% of the
ratios clipped), Adam lr 3e-4, and lambda_KL warming from 0.01 to 1.0 over 20 updates with D_target = 3e-4, inside the
observed KL range so that the adaptive rule actually moves (see LabConfig).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from ..advantage import group_advantages
from ..equalizer import equalizer_weights, gradient_scale
from ..grpo import PairBatch, grpo_backward, plan_steps
from ..kl import (
    KL_VARIANTS,
    MOVING_ANCHOR_VARIANTS,
    POSITION_VARIANTS,
    VELOCITY_VARIANTS,
    AdaptiveKLController,
)
from ..schedule import sigma_schedule
from ..sde import check_sampler, sde_step
from ..window import prefix_steps, window_index, window_masks, window_positions
from .data import RingManifold
from .metrics import log_spread, per_step_grad_norms, sample_metrics
from .model import mlp_flops, ode_sample

__all__ = ["KL_VARIANTS", "LAB_SAMPLERS", "LabConfig", "Trajectory", "RunResult", "rollout", "train_grpo", "summarize"]

LAB_SAMPLERS = ("dance_grpo", "flow_grpo", "sage_grpo", "cps")  # the SDE samplers (ode has no exploration)


@dataclass
class LabConfig:
    """One lab run. Defaults are toy-scale (see the module docstring)."""

    sampler: str = "sage_grpo"  # one of LAB_SAMPLERS
    equalizer: bool = True  # weight the per-step policy loss by S_t
    kl: str = "dual"  # one of KL_VARIANTS
    eta: float = 0.5  # exploration scale of the SDE (the spec's sanity-table value for every sampler)
    num_steps: int = 20  # T
    shift: float = 3.0  # schedule shift: a 50x spread of the gradient scale N_t, like the video schedule
    iterations: int = 40  # rollout batches
    num_groups: int = 8  # "prompts" per rollout batch (the toy is unconditional: a group = G rollouts)
    group_size: int = 8  # G
    timestep_fraction: float = 0.5  # trained steps per sample: int(T * fraction)
    permute_timesteps: bool = True
    updates_per_rollout: int = 2  # optimizer updates per rollout batch (disjoint sample minibatches)
    lr: float = 3e-4  # Adam
    clip_range: float = 0.01  # PPO clip of the ratio (peers: 1e-4 for video-scale averaged log-probs)
    max_grad_norm: float = 1.0
    adv_clip_max: float = 5.0
    cps_logprob: str = "peer"  # as in the video loop; "normalized" = the Gaussian density
    kl_refresh_every: int = 10  # moving anchor refresh, in optimizer updates (update_ref_model_step)
    kl_beta_pos: float = 1.0  # dual_kl_moving_weight
    kl_beta_vel: float = 0.1  # dual_kl_step_weight
    kl_stepwise_beta_vel: float = 1.0  # weight of KL_vel when it is the only term ("stepwise")
    kl_init: float = 0.01  # lambda_KL at update 0 (paper: 1e-7)
    kl_min: float = 0.01  # lambda_min (paper: 1e-7)
    kl_max: float = 1.0  # lambda_max (paper: 1e-5)
    kl_target: float = 3e-4  # D_target (paper: 1e-5 = kl_weight)
    kl_warmup: int = 20  # warm-up updates (paper: 100)
    kl_history: int = 10
    kl_direction: str = "paper"  # "paper": KL far above target relaxes lambda; "classic": tightens it
    eval_every: int = 5  # iterations between ODE evaluations
    eval_samples: int = 500
    grad_norm_batch: int = 32  # rollouts used to measure per-step gradient norms (Fig. 3-4)
    grad_norms_at_end: bool = False  # also measure them on the final policy (one more rollout + T vmapped grads)
    seed: int = 0
    # SDE window (post_train.py's --sde_window_*; sage_grpo.window): SDE steps only in [start, start + size), ODE
    # elsewhere; size 0 = to the last step; stride > 0 slides it every `window_every` optimizer updates
    window_start: int = 0
    window_size: int = 0
    window_stride: int = 0
    window_every: int = 2
    same_noise: bool = False  # one initial noise per group (--use_same_noise)
    shared_prefix: bool = False  # the ODE steps before the window once per group (--shared_prefix)

    def validate(self) -> LabConfig:
        check_sampler(self.sampler)
        if self.sampler not in LAB_SAMPLERS:
            raise ValueError(f"the lab trains SDE samplers only: {', '.join(LAB_SAMPLERS)}; got {self.sampler!r}")
        if self.kl not in KL_VARIANTS:
            raise ValueError(f"unknown kl {self.kl!r}; valid variants: {', '.join(KL_VARIANTS)}")
        if self.num_groups * self.group_size % self.updates_per_rollout:
            raise ValueError("num_groups * group_size must be divisible by updates_per_rollout")
        window_positions(self.num_steps, self.window_start, self.window_size, self.window_stride)  # inside T
        if self.shared_prefix and not self.same_noise:
            raise ValueError("shared_prefix needs same_noise (the samples of a group differ from x_0 otherwise)")
        return self

    @property
    def uses_kl_pos(self) -> bool:
        return self.kl in POSITION_VARIANTS

    @property
    def uses_kl_vel(self) -> bool:
        return self.kl in VELOCITY_VARIANTS

    @property
    def refreshes_anchor(self) -> bool:
        return self.kl in MOVING_ANCHOR_VARIANTS


@dataclass
class Trajectory:
    """A rollout batch. B = samples, T = steps, D = data dim."""

    latents: Tensor  # [T + 1, B, D] x_0 (noise) .. x_T (sample)
    log_probs: Tensor  # [T, B] rollout log-probs
    std: Tensor  # [T] injected noise std per step (schedule-only; 0 at ODE steps outside the SDE window)
    forwards: int = 0  # per-sample policy forwards the rollout took


@dataclass
class RunResult:
    """Everything a run reports; plain types except the per-step tensors."""

    config: dict
    history: list[dict] = field(default_factory=list)  # one row per iteration (eval keys every eval_every)
    final: dict = field(default_factory=dict)  # ODE-evaluation metrics of the final policy
    base: dict = field(default_factory=dict)  # the same metrics for the pre-trained model
    noise_std: Tensor | None = None  # [T] (Fig. 9)
    equalizer: Tensor | None = None  # [T] S_t
    predicted_scale: Tensor | None = None  # [T] N_t, the predicted per-step gradient scale
    grad_norms_start: Tensor | None = None  # [T] measured per-step norms on the base model's first rollout
    grad_norms_end: Tensor | None = None  # [T] the same on the final policy (cfg.grad_norms_at_end)
    wall_s: float = 0.0


@torch.no_grad()
def rollout(
    policy: nn.Module, noise: Tensor, sigmas: Tensor, cfg: LabConfig, generator: torch.Generator,
    sde_steps: Tensor | None = None,
) -> Trajectory:
    """T steps from `noise` [B, D]: cfg.sampler at the SDE steps `sde_steps` [T] bool (default: all), the ODE step
    elsewhere (no draw from `generator`); the SDE noise is drawn from `generator`. With cfg.shared_prefix the ODE
    steps before the window run once per group (the groups are contiguous runs of cfg.group_size samples, which
    start from one noise under cfg.same_noise)."""
    num_steps = sigmas.numel() - 1
    sde = torch.ones(num_steps, dtype=torch.bool) if sde_steps is None else sde_steps
    x = noise
    latents, log_probs, std, forwards = [x], [], [], 0
    prefix = prefix_steps(sde) if cfg.shared_prefix else 0
    for t in range(num_steps):
        s, s_next = float(sigmas[t]), float(sigmas[t + 1])
        if t < prefix:  # one forward per group, its result for every sample of the group
            rep = x[:: cfg.group_size]  # [groups, D]
            v = policy(rep, torch.full((rep.shape[0],), s)).repeat_interleave(cfg.group_size, dim=0)  # [B, D]
            forwards += rep.shape[0]
        else:
            v = policy(x, torch.full((x.shape[0],), s))  # [B, D]
            forwards += x.shape[0]
        if sde[t]:
            out = sde_step(cfg.sampler, v, x, s, s_next, cfg.eta, sigma_max=sigmas[1], generator=generator,
                           cps_logprob=cfg.cps_logprob)
            log_probs.append(out.log_prob)
        else:
            out = sde_step("ode", v, x, s, s_next, 0.0, noise=torch.zeros_like(x))
            log_probs.append(torch.full_like(out.log_prob, math.nan))  # never trained
        x = out.prev_sample
        latents.append(x)
        std.append(out.std[0])
    return Trajectory(latents=torch.stack(latents), log_probs=torch.stack(log_probs), std=torch.stack(std),
                      forwards=forwards)


def _evaluate(model: nn.Module, data: RingManifold, noise: Tensor, cfg: LabConfig,
              base_samples: Tensor | None = None) -> dict[str, float]:
    """ODE samples from fixed noise (the validation protocol of the video loop) -> sample_metrics, and with the base
    model's samples of the same noise [n, D] their `drift` from them (the video lab's drift: the RMS difference
    over the coordinates, mean over the samples)."""
    was_training = model.training
    model.eval()
    x = ode_sample(model, noise, cfg.num_steps, cfg.shift)  # [n, D]
    model.train(was_training)
    out = sample_metrics(data, x)
    if base_samples is not None:
        out["drift"] = float((x - base_samples).pow(2).mean(dim=1).sqrt().mean())
    return out


def train_grpo(cfg: LabConfig, data: RingManifold, base_model: nn.Module) -> RunResult:
    """Post-train a copy of `base_model` with GRPO under `cfg` -> RunResult. Deterministic for cfg.seed."""
    cfg.validate()
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)  # rollout noise, timestep choice, minibatch shuffles
    eval_noise = torch.randn(cfg.eval_samples, data.dim, generator=torch.Generator().manual_seed(10_000 + cfg.seed))

    policy = copy.deepcopy(base_model).train().requires_grad_(True)
    anchor = copy.deepcopy(base_model).eval().requires_grad_(False) if cfg.uses_kl_pos else None
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    controller = None
    if cfg.kl != "none":
        controller = AdaptiveKLController(
            init=cfg.kl_init, lambda_min=cfg.kl_min, lambda_max=cfg.kl_max, target=cfg.kl_target,
            warmup_updates=cfg.kl_warmup, history=cfg.kl_history, direction=cfg.kl_direction,
        )

    sigmas = sigma_schedule(cfg.num_steps, cfg.shift)  # [T + 1] fp64
    windows = window_masks(cfg.num_steps, cfg.window_start, cfg.window_size, cfg.window_stride)  # [P, T]
    s_eq = equalizer_weights(cfg.sampler, sigmas, cfg.eta, cps_logprob=cfg.cps_logprob)  # [T]
    # [P, T]: S_t normalised over each window's steps (the whole schedule's S_t without a window)
    weights = torch.stack([equalizer_weights(cfg.sampler, sigmas, cfg.eta, cps_logprob=cfg.cps_logprob, steps=w)
                           if cfg.equalizer else torch.ones(cfg.num_steps) for w in windows])
    batch = cfg.num_groups * cfg.group_size
    group_ids = torch.arange(cfg.num_groups).repeat_interleave(cfg.group_size)  # [B]
    beta_pos = cfg.kl_beta_pos if cfg.uses_kl_pos else 0.0
    beta_vel = (cfg.kl_stepwise_beta_vel if cfg.kl == "stepwise" else cfg.kl_beta_vel) if cfg.uses_kl_vel else 0.0
    anchor_synced = True  # the anchor equals the policy (initial copy or just refreshed) until the next update

    predicted = gradient_scale(cfg.sampler, sigmas, cfg.eta, cps_logprob=cfg.cps_logprob)  # [T]
    result = RunResult(config=asdict(cfg), equalizer=s_eq, predicted_scale=predicted)
    base_samples = ode_sample(base_model.eval(), eval_noise, cfg.num_steps, cfg.shift)  # [n, D]
    result.base = _evaluate(policy, data, eval_noise, cfg, base_samples)
    flops = mlp_flops(policy)
    num_updates = 0
    for it in range(cfg.iterations):
        row: dict = {"iteration": it}
        if it % cfg.eval_every == 0:
            row.update({f"eval/{k}": v for k, v in _evaluate(policy, data, eval_noise, cfg, base_samples).items()})

        # 1. rollout, 2. reward and advantages
        if cfg.same_noise:
            noise = torch.randn(cfg.num_groups, data.dim, generator=gen).repeat_interleave(cfg.group_size, dim=0)
        else:
            noise = torch.randn(batch, data.dim, generator=gen)  # [B, D]
        w = window_index(len(windows), cfg.window_every, num_updates)  # the window of this rollout
        traj = rollout(policy, noise, sigmas, cfg, gen, windows[w])
        forwards = traj.forwards
        trained_pairs = anchor_forwards = 0  # re-scored (forward + backward) pairs; the anchor's forwards
        rewards = data.reward(traj.latents[-1])  # [B]
        adv, valid = group_advantages(rewards, group_ids, adv_clip_max=cfg.adv_clip_max)  # [B], [B]
        if it == 0:
            result.noise_std = traj.std.clone()
            result.grad_norms_start = _grad_norms(policy, traj, sigmas, cfg)

        # 3. updates through the shared GRPO update (sage_grpo.grpo): each a disjoint minibatch of samples, all of
        # its (sample, step) pairs re-scored in one forward
        steps = plan_steps(batch, traj.std**2, cfg.timestep_fraction, cfg.permute_timesteps, gen)  # [B, k]
        order = torch.randperm(batch, generator=gen)  # [B]
        stats_acc: dict[str, list[float]] = {}
        for mb in order.chunk(cfg.updates_per_rollout):
            pairs = PairBatch(samples=mb.repeat_interleave(steps.shape[1]), steps=steps[mb].reshape(-1))
            opt.zero_grad(set_to_none=True)
            forwards += pairs.samples.numel() * (2 if cfg.uses_kl_pos and not anchor_synced else 1)  # + anchor's
            trained_pairs += pairs.samples.numel()
            anchor_forwards += pairs.samples.numel() if cfg.uses_kl_pos and not anchor_synced else 0
            mb_stats = grpo_backward(
                pairs, lambda i, t, tr=traj: _rescore(policy, tr, sigmas, i, t, cfg),
                logp_old=traj.log_probs.T, advantages=adv, valid=valid, step_weights=weights[w],
                clip_range=cfg.clip_range, normalizer=max(int(valid[pairs.samples].sum()), 1),
                kl_coef=controller.value if controller is not None else 0.0, beta_pos=beta_pos, beta_vel=beta_vel,
                anchor_fn=(lambda b, tr=traj: _rescore(anchor, tr, sigmas, b.samples, b.steps, cfg).mean),
                anchor_is_policy=anchor_synced,
            )
            gnorm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            opt.step()
            num_updates += 1
            anchor_synced = False
            summary = mb_stats.summary()
            if controller is not None:
                _acc(stats_acc, "kl/coef", controller.value)
                controller.update(summary["kl/loss"])
            if cfg.refreshes_anchor and num_updates % cfg.kl_refresh_every == 0:
                anchor.load_state_dict(policy.state_dict())
                anchor_synced = True
            for key in ("kl/loss", "kl/pos", "kl/vel", "train/clipfrac", "train/approx_kl"):
                if key in summary:
                    _acc(stats_acc, key, summary[key])
            _acc(stats_acc, "train/grad_norm", float(gnorm))
        row["reward/rollout"] = float(rewards.mean())
        row["forwards_per_sample"] = forwards / batch
        # model FLOPs per sample by phase, as the video loop's meter splits them (perf/<phase>_tflop)
        row["flop_rollout"] = traj.forwards * flops["forward"] / batch
        row["flop_anchor"] = anchor_forwards * flops["forward"] / batch
        row["flop_update"] = trained_pairs * (flops["forward"] + flops["backward"]) / batch
        row["off_manifold/rollout"] = float(data.distance_to_support(traj.latents[-1]).mean())
        row.update({k: sum(v) / len(v) for k, v in stats_acc.items()})
        result.history.append(row)

    result.final = _evaluate(policy, data, eval_noise, cfg, base_samples)
    result.history.append({"iteration": cfg.iterations, **{f"eval/{k}": v for k, v in result.final.items()}})
    if cfg.grad_norms_at_end:
        traj = rollout(policy, torch.randn(batch, data.dim, generator=gen), sigmas, cfg, gen)
        result.grad_norms_end = _grad_norms(policy, traj, sigmas, cfg)
    result.wall_s = time.perf_counter() - t_start
    return result


def _rescore(model: nn.Module, traj: Trajectory, sigmas: Tensor, i: Tensor, t: Tensor, cfg: LabConfig):
    """The step callback of the shared update: re-score stored transitions (i, t) [P] under `model`."""
    x_t, x_next = traj.latents[t, i], traj.latents[t + 1, i]  # [P, D]
    s, s_next = sigmas[t].float(), sigmas[t + 1].float()  # [P]
    return sde_step(
        cfg.sampler, model(x_t, s), x_t, s, s_next, cfg.eta, sigma_max=sigmas[1], prev_sample=x_next,
        cps_logprob=cfg.cps_logprob,
    )


def _grad_norms(policy: nn.Module, traj: Trajectory, sigmas: Tensor, cfg: LabConfig) -> Tensor:
    """Per-step RMS log-prob gradient norms on the first cfg.grad_norm_batch rollouts -> [T]."""
    lat = traj.latents[:, : cfg.grad_norm_batch]  # [T + 1, n, D]
    return per_step_grad_norms(policy, lat, sigmas, sampler=cfg.sampler, eta=cfg.eta, cps_logprob=cfg.cps_logprob)


def _acc(acc: dict[str, list[float]], key: str, value: float) -> None:
    acc.setdefault(key, []).append(value)


def summarize(result: RunResult) -> dict:
    """Flat per-run summary (one CSV row): config keys, base/final metrics and gradient-norm spreads."""
    cfg = result.config
    s_eq = result.equalizer
    g0 = result.grad_norms_start
    row = {k: cfg[k] for k in ("sampler", "equalizer", "kl", "seed", "eta", "num_steps", "shift", "iterations")}
    row.update({f"base_{k}": v for k, v in result.base.items()})
    row.update({f"final_{k}": v for k, v in result.final.items()})
    # Spread in orders of magnitude, log10(max/min) over the stochastic steps, of the measured per-step norms
    # without (raw) and with (times S_t) the equalizer, and of the prediction N_t (same steps).
    row["grad_spread_raw"] = log_spread(g0)
    row["grad_spread_eq"] = log_spread(g0 * s_eq.double())
    row["grad_spread_pred"] = log_spread(result.predicted_scale * (g0 > 0))
    row["wall_s"] = result.wall_s
    per_iter = [h["forwards_per_sample"] for h in result.history if "forwards_per_sample" in h]
    row["forwards_per_sample_iter"] = sum(per_iter) / len(per_iter)  # policy forwards: rollout, update, anchor
    for phase in ("rollout", "anchor", "update"):  # model FLOPs per sample and iteration, mean over the run
        per_iter = [h[f"flop_{phase}"] for h in result.history if f"flop_{phase}" in h]
        row[f"flop_{phase}_iter"] = sum(per_iter) / len(per_iter)
    row["flop_iter"] = sum(row[f"flop_{phase}_iter"] for phase in ("rollout", "anchor", "update"))
    return row
