"""Tests of the seconds-scale lab (sage_grpo/lab): the toy data, the pre-trained flow, GRPO, metrics, report.

One 2-D flow is pre-trained per module (a few seconds, seeded) and shared; every check compares against an
independent computation or a property the code must have, and can fail.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from sage_grpo.equalizer import equalizer_weights
from sage_grpo.lab import (
    LabConfig,
    RingManifold,
    log_spread,
    ode_sample,
    per_step_grad_norms,
    pretrain_flow,
    rollout,
    sample_metrics,
    train_grpo,
)
from sage_grpo.lab.grpo import summarize
from sage_grpo.lab.model import mlp_flops
from sage_grpo.lab.report import aggregate, format_table
from sage_grpo.schedule import sigma_schedule
from sage_grpo.sde import mean_sensitivity, sde_step, step_variance

PRETRAIN_STEPS = 1000


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny MLPs: threads only add synchronisation (and nondeterminism across counts)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def ring() -> RingManifold:
    return RingManifold(dim=2)


@pytest.fixture(scope="module")
def base_flow(ring):
    return pretrain_flow(ring, seed=0, steps=PRETRAIN_STEPS)


# ----------------------------------------------------------------------------------------------------- data


@pytest.mark.parametrize("dim", [2, 16])
def test_distance_to_support_is_exact(dim):
    ring = RingManifold(dim=dim, radius=1.5)
    q = ring.basis  # [D, 2]
    assert torch.allclose(q.T @ q, torch.eye(2), atol=1e-6)
    g = torch.Generator().manual_seed(0)
    theta = torch.rand(50, generator=g) * 2 * math.pi
    a = torch.rand(50, generator=g) - 0.5  # radial offset
    b = torch.rand(50, generator=g)  # out-of-plane offset (0 in 2-D)
    plane = (1.5 + a)[:, None] * torch.stack([theta.cos(), theta.sin()], 1)  # [n, 2]
    x = plane @ q.T  # [n, D]
    if dim > 2:
        normal = torch.randn(dim, generator=g)
        normal = normal - q @ (q.T @ normal)  # remove the in-plane part
        x = x + b[:, None] * normal / normal.norm()
        expected = torch.sqrt(a**2 + b**2)
    else:
        expected = a.abs()
    assert torch.allclose(ring.distance_to_support(x), expected, atol=1e-5)
    data = ring.sample(1000, generator=g)
    assert float(ring.distance_to_support(data).max()) < 1e-5


def test_modes_and_reward(ring):
    centres = ring.radius * torch.stack([ring.mode_angles.cos(), ring.mode_angles.sin()], 1)  # [K, 2]
    assert torch.equal(ring.assign_modes(centres), torch.arange(ring.num_modes))
    r = ring.reward(centres)
    assert r[ring.target_mode] == pytest.approx(1.0)
    assert r[(ring.target_mode + ring.num_modes // 2) % ring.num_modes] == pytest.approx(-1.0, abs=1e-6)
    # The reward can be exploited off the manifold: radially outward from the target mode it keeps growing.
    assert float(ring.reward(2 * centres[ring.target_mode : ring.target_mode + 1])) == pytest.approx(2.0)


def test_sample_metrics_on_data_and_collapse(ring):
    g = torch.Generator().manual_seed(1)
    m = sample_metrics(ring, ring.sample(4000, generator=g))
    assert m["off_manifold"] < 1e-5 and m["mode_coverage"] == 1.0 and m["mode_entropy"] > 0.99
    collapsed = torch.tensor([[ring.radius, 0.0]]).repeat(100, 1)  # every sample at the target mode centre
    m = sample_metrics(ring, collapsed)
    assert m["mode_coverage"] == pytest.approx(1 / ring.num_modes) and m["mode_entropy"] == 0.0
    assert m["reward"] == pytest.approx(1.0) and m["target_mode_frac"] == 1.0


# ------------------------------------------------------------------------------------------ pre-trained flow


def _check_reproduces(ring, model, tol_dist: float):
    noise = torch.randn(3000, ring.dim, generator=torch.Generator().manual_seed(7))
    x = ode_sample(model, noise, num_steps=20, shift=3.0)
    m = sample_metrics(ring, x)
    frac = torch.bincount(ring.assign_modes(x), minlength=ring.num_modes).float() / x.shape[0]
    assert m["off_manifold"] < tol_dist, m
    assert m["mode_coverage"] == 1.0, m
    assert float((frac - 1 / ring.num_modes).abs().max()) < 0.04, frac  # every mode near 12.5%
    assert abs(m["reward"]) < 0.08, m  # the data's mean reward is 0


def test_pretrained_flow_reproduces_data(ring, base_flow):
    _check_reproduces(ring, base_flow, tol_dist=0.06)


@pytest.mark.slow
def test_pretrained_flow_reproduces_data_16d():
    ring = RingManifold(dim=16)
    _check_reproduces(ring, pretrain_flow(ring, seed=0), tol_dist=0.12)


# --------------------------------------------------------------------------------------------------- GRPO


def test_rollout_log_probs_rescore_exactly(ring, base_flow):
    """Re-scoring the stored x_{t+1} with the same parameters must give ratio == 1 (README "The samplers",
    log-probabilities)."""
    cfg = LabConfig(sampler="flow_grpo", num_steps=8)
    sigmas = sigma_schedule(cfg.num_steps, cfg.shift)
    noise = torch.randn(16, 2, generator=torch.Generator().manual_seed(0))
    traj = rollout(base_flow, noise, sigmas, cfg, torch.Generator().manual_seed(1))
    for t in range(cfg.num_steps):
        s, s_next = float(sigmas[t]), float(sigmas[t + 1])
        with torch.no_grad():
            v = base_flow(traj.latents[t], torch.full((16,), s))
            out = sde_step(cfg.sampler, v, traj.latents[t], s, s_next, cfg.eta, sigma_max=sigmas[1],
                           prev_sample=traj.latents[t + 1])
        assert torch.equal(out.log_prob, traj.log_probs[t])
    expected_std = step_variance("flow_grpo", sigmas[:-1], sigmas[1:], cfg.eta, sigma_max=sigmas[1]).sqrt()
    assert torch.allclose(traj.std.double(), expected_std, rtol=1e-5)


def test_window_rollout_ode_outside_shared_prefix_and_forward_count(ring, base_flow):
    """Outside the SDE window the lab takes the ODE step (NaN log-prob, no draw from the generator); the shared
    prefix gives every sample of a group its group's ODE steps from one forward; a windowed run counts exactly the
    forwards it needs (rollout + trained pairs + the anchor's once it has moved)."""
    from sage_grpo.window import window_mask

    cfg = LabConfig(sampler="sage_grpo", num_steps=8, group_size=4, num_groups=2, same_noise=True,
                    shared_prefix=True)
    sigmas = sigma_schedule(8, cfg.shift)
    noise = torch.randn(2, 2, generator=torch.Generator().manual_seed(0)).repeat_interleave(4, dim=0)  # [8, 2]
    window = window_mask(8, 3, 5)
    shared = rollout(base_flow, noise, sigmas, cfg, torch.Generator().manual_seed(1), window)
    separate = rollout(base_flow, noise, sigmas, LabConfig(**{**cfg.__dict__, "shared_prefix": False}),
                       torch.Generator().manual_seed(1), window)
    assert torch.isnan(shared.log_probs[[0, 1, 2, 5, 6, 7]]).all() and torch.isfinite(shared.log_probs[3:5]).all()
    assert (shared.std[[0, 1, 2, 5, 6, 7]] == 0).all() and (shared.std[3:5] > 0).all()
    torch.testing.assert_close(shared.latents, separate.latents, rtol=0, atol=1e-6)
    assert shared.forwards == 3 * 2 + 5 * 8 and separate.forwards == 8 * 8
    for t in (0, 5):  # an ODE step is the Euler step, computed here independently
        with torch.no_grad():
            v = base_flow(separate.latents[t], torch.full((8,), float(sigmas[t])))
        euler = separate.latents[t] + (sigmas[t + 1] - sigmas[t]).float() * v
        torch.testing.assert_close(separate.latents[t + 1], euler, rtol=0, atol=1e-6)
    # a fixed window of 2 steps, fraction 0.5 trains 1 step per sample; dual KL: the anchor's forwards from the
    # second update of each refresh period on (2 updates per rollout, refresh every 10)
    run = train_grpo(LabConfig(sampler="sage_grpo", kl="dual", num_steps=8, window_start=3, window_size=2,
                               iterations=2, num_groups=2, group_size=4, eval_every=5), ring, base_flow)
    per = [h["forwards_per_sample"] for h in run.history if "forwards_per_sample" in h]
    # rollout 8 steps; 2 updates on 4 samples x 1 step; the anchor on the 3 updates after the first
    assert per == [8 + 1 + 0.5, 8 + 1 + 1]
    # the same counts in model FLOPs by phase: forward F per rollout and anchor forward, F + B per trained pair
    f = mlp_flops(base_flow)
    rows = [h for h in run.history if "flop_rollout" in h]
    assert [h["flop_rollout"] for h in rows] == [8 * f["forward"]] * 2
    assert [h["flop_anchor"] for h in rows] == [0.5 * f["forward"], 1 * f["forward"]]
    assert [h["flop_update"] for h in rows] == [1 * (f["forward"] + f["backward"])] * 2


def test_mlp_flops_are_what_torch_counts_for_a_forward_and_a_trained_backward(base_flow):
    """mlp_flops against torch.utils.flop_counter on the lab's real forward and the backward of a trained MLP (its
    first layer's input gradient not computed: x and sigma need none)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = copy.deepcopy(base_flow).requires_grad_(True)
    x, sigma = torch.randn(5, 2), torch.rand(5)
    with FlopCounterMode(display=False) as fwd:
        out = model(x, sigma)
    with FlopCounterMode(display=False) as bwd:
        out.pow(2).sum().backward()
    f = mlp_flops(model)
    assert fwd.get_total_flops() == 5 * f["forward"]
    assert bwd.get_total_flops() == 5 * f["backward"]
    assert f["backward"] < 2 * f["forward"]  # the first layer's input gradient is not computed


def test_the_lab_drift_is_the_rms_distance_from_the_base_models_samples(ring, base_flow):
    """eval/drift: 0 for the base model itself (every run's first evaluation); for another model, the RMS distance
    over the coordinates of its ODE samples from the base model's on the same noise, mean over the samples,
    recomputed here with numpy; a run's later evaluations have moved."""
    import numpy as np

    from sage_grpo.lab.grpo import _evaluate

    cfg = LabConfig(sampler="sage_grpo", kl="none", iterations=3, eval_every=3, eval_samples=64, seed=2)
    res = train_grpo(cfg, ring, base_flow)
    assert res.base["drift"] == 0.0 and res.history[0]["eval/drift"] == 0.0 and res.final["drift"] > 0
    noise = torch.randn(64, 2, generator=torch.Generator().manual_seed(7))
    base = ode_sample(base_flow, noise, cfg.num_steps, cfg.shift)
    moved = copy.deepcopy(base_flow)
    with torch.no_grad():
        moved.net[-1].bias += torch.tensor([0.3, -0.1])
    got = _evaluate(moved, ring, noise, cfg, base)["drift"]
    a, b = ode_sample(moved, noise, cfg.num_steps, cfg.shift).numpy(), base.numpy()
    assert got == pytest.approx(float(np.sqrt(((a - b) ** 2).mean(axis=1)).mean()), rel=1e-6)
    assert got > 0.05


def test_short_grpo_run_raises_reward(ring, base_flow):
    res = train_grpo(LabConfig(sampler="sage_grpo", kl="none", iterations=20, seed=0), ring, base_flow)
    assert res.final["reward"] > res.base["reward"] + 0.15, (res.base, res.final)
    assert res.final["target_mode_frac"] > res.base["target_mode_frac"] + 0.05
    rollout_reward = [h["reward/rollout"] for h in res.history if "reward/rollout" in h]
    assert sum(rollout_reward[-5:]) / 5 > sum(rollout_reward[:5]) / 5 + 0.1


def test_runs_are_deterministic_for_a_seed(ring, base_flow):
    cfg = LabConfig(sampler="cps", kl="dual", iterations=3, eval_every=1, kl_refresh_every=2, seed=3,
                    grad_norms_at_end=True)
    a, b = train_grpo(cfg, ring, base_flow), train_grpo(cfg, ring, base_flow)
    assert a.history == b.history and a.final == b.final
    assert torch.equal(a.grad_norms_end, b.grad_norms_end)
    c = train_grpo(LabConfig(**{**a.config, "seed": 4}), ring, base_flow)
    assert c.history != a.history


@pytest.mark.parametrize("kl", ["none", "fixed", "moving", "stepwise", "dual", "dual_fixed"])
def test_kl_variants_log_their_terms(ring, base_flow, kl):
    from sage_grpo.kl import KL_VARIANTS

    assert kl in KL_VARIANTS  # the lab runs the video loop's variants
    res = train_grpo(LabConfig(sampler="dance_grpo", kl=kl, iterations=2, kl_refresh_every=1), ring, base_flow)
    row = res.history[1]
    assert ("kl/pos" in row) == (kl in ("fixed", "moving", "dual", "dual_fixed"))
    assert ("kl/vel" in row) == (kl in ("stepwise", "dual", "dual_fixed"))
    assert ("kl/coef" in row) == (kl != "none")
    assert all(math.isfinite(v) for v in row.values())
    if kl == "moving":  # refreshed after every update, so every update sees anchor == policy: KL_pos = 0
        assert row["kl/pos"] < 1e-10
    if kl in ("fixed", "dual_fixed"):  # the never-refreshed anchor differs from the policy after the first updates
        assert row["kl/pos"] > 0


def test_invalid_config_names_valid_choices():
    with pytest.raises(ValueError, match="dance_grpo"):
        LabConfig(sampler="ode").validate()
    with pytest.raises(ValueError, match="stepwise"):
        LabConfig(kl="bogus").validate()


# ------------------------------------------------------------------------------------ gradient-norm balance


_GRAD_NORMS: dict = {}


def _grad_norms(ring, model, sampler, cps_logprob="peer", seed=0):
    """Measured per-step norms on one seeded rollout of the base flow (memoised: several tests share them)."""
    key = (id(model), sampler, cps_logprob, seed)
    if key not in _GRAD_NORMS:
        _GRAD_NORMS[key] = _measure_grad_norms(ring, model, sampler, cps_logprob, seed)
    return _GRAD_NORMS[key]


def _measure_grad_norms(ring, model, sampler, cps_logprob, seed):
    cfg = LabConfig(sampler=sampler, cps_logprob=cps_logprob)
    sigmas = sigma_schedule(cfg.num_steps, cfg.shift)
    noise = torch.randn(64, ring.dim, generator=torch.Generator().manual_seed(seed))
    traj = rollout(model, noise, sigmas, cfg, torch.Generator().manual_seed(seed + 1))
    g = per_step_grad_norms(model, traj.latents, sigmas, sampler=sampler, eta=cfg.eta, cps_logprob=cps_logprob)
    return g, sigmas, cfg


@pytest.mark.parametrize(
    ("sampler", "cps_logprob", "max_ratio"),
    [("dance_grpo", "peer", 0.8), ("flow_grpo", "peer", 0.5), ("sage_grpo", "peer", 0.5), ("cps", "normalized", 0.5),
     ("cps", "peer", 0.8)],
)
def test_equalizer_shrinks_gradient_norm_spread(ring, base_flow, sampler, cps_logprob, max_ratio):
    """Paper Fig. 3-4 on the toy: per-step gradient norms span less with S_t than without.

    flow/sage/cps span about 1.5-2 orders of magnitude on this schedule (measured ~1.5-2.0) and must shrink to at
    most half of that (measured ~0.4); dance's N_t and the cps peer-log-prob scale vary only ~5x (measured 0.7 -> 0.4
    for both), so 80% is required there.
    """
    g, sigmas, cfg = _grad_norms(ring, base_flow, sampler, cps_logprob)
    s_eq = equalizer_weights(sampler, sigmas, cfg.eta, cps_logprob=cps_logprob).double()
    raw, eq = log_spread(g), log_spread(g * s_eq)
    assert eq < max_ratio * raw, (raw, eq)


@pytest.mark.parametrize(
    ("sampler", "cps_logprob", "min_corr"),
    [("dance_grpo", "peer", 0.6), ("flow_grpo", "peer", 0.9), ("sage_grpo", "peer", 0.9), ("cps", "normalized", 0.9)],
)
def test_measured_norms_follow_predicted_scale(ring, base_flow, sampler, cps_logprob, min_corr):
    """log ||grad_t|| tracks log N_t = log(|d mean/d v| / sqrt(V_t)) (paper Eq. 8, Fig. 4). dance's N_t varies
    least, so the network's own sigma-dependence weighs more there (measured correlation ~0.8 vs ~0.98)."""
    g, sigmas, cfg = _grad_norms(ring, base_flow, sampler, cps_logprob)
    var = step_variance(sampler, sigmas[:-1], sigmas[1:], cfg.eta, sigma_max=sigmas[1])
    keep = var > 0
    pred = mean_sensitivity(sampler, sigmas[:-1], sigmas[1:], var).abs() / var.sqrt()  # independent of equalizer.py
    assert float(torch.corrcoef(torch.stack([g[keep].log(), pred[keep].log()]))[0, 1]) > min_corr


def test_cps_peer_log_prob_norms_scale_with_std_not_inverse_std(ring, base_flow):
    """With the peers' cps log-prob -(x' - mean)^2 (no 1/(2 s^2)), d log pi / d mean = 2 (x' - mean) ~ s_t, so the
    measured norms follow s_t * |d mean/d v|, not the Gaussian proxy |d mean/d v| / s_t; this is why equalizer.py
    uses s_t * |d mean/d v| for cps with the peer log-prob (see the README Lab section)."""
    g, sigmas, cfg = _grad_norms(ring, base_flow, "cps", "peer")
    var = step_variance("cps", sigmas[:-1], sigmas[1:], cfg.eta)
    sens = mean_sensitivity("cps", sigmas[:-1], sigmas[1:], var).abs()
    keep = var > 0
    corr_peer = torch.corrcoef(torch.stack([g[keep].log(), (sens * var.sqrt())[keep].log()]))[0, 1]
    corr_n = torch.corrcoef(torch.stack([g[keep].log(), (sens / var.sqrt())[keep].log()]))[0, 1]
    assert float(corr_peer) > 0.6 and float(corr_n) < 0.0, (float(corr_peer), float(corr_n))  # measured ~0.75, ~-0.3


# ----------------------------------------------------------------------------------------------------- report


def test_aggregate_and_table():
    rows = []
    for seed, (r, d) in enumerate([(0.5, 0.1), (0.7, 0.3)]):
        rows.append({"dim": 2, "sampler": "sage_grpo", "equalizer": True, "kl": "dual", "seed": seed,
                     "final_reward": r, "final_off_manifold": d, "final_mode_coverage": 1.0, "final_mode_entropy": 0.9,
                     "base_reward": 0.0, "base_off_manifold": 0.02, "base_mode_coverage": 1.0,
                     "base_mode_entropy": 1.0, "grad_spread_raw": 2.0, "grad_spread_eq": 0.5})
    (agg,) = aggregate(rows)
    assert agg["n"] == 2 and agg["final_reward_mean"] == pytest.approx(0.6)
    assert agg["final_reward_std"] == pytest.approx(math.sqrt(0.02))  # sample std of (0.5, 0.7)
    assert agg["grad_spread_applied_mean"] == pytest.approx(0.5)  # equalizer on -> the equalized spread
    table = format_table([agg], ["sage_grpo"], ["dual"], dim=2)
    assert "| sage_grpo | on | dual | 0.600 ± 0.141 | 0.200 ± 0.141 |" in table
    assert table.splitlines()[2].startswith("| Pre-trained flow")


def test_summarize_reports_spreads(ring, base_flow):
    res = train_grpo(LabConfig(sampler="flow_grpo", kl="none", iterations=1), ring, base_flow)
    s = summarize(res)
    assert s["grad_spread_raw"] == pytest.approx(log_spread(res.grad_norms_start))
    assert s["grad_spread_eq"] < s["grad_spread_raw"]
    assert s["final_reward"] == res.final["reward"] and s["base_reward"] == res.base["reward"]
