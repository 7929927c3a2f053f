"""The shared GRPO update (sage_grpo.grpo) against an independent computation of the loss it must backpropagate."""

from __future__ import annotations

import math

import pytest
import torch

from sage_grpo.equalizer import equalizer_weights
from sage_grpo.grpo import PairBatch, grpo_backward, micro_batches, plan_steps, stochastic_steps, update_chunks
from sage_grpo.lab.model import VelocityMLP
from sage_grpo.schedule import sigma_schedule
from sage_grpo.sde import sde_step, step_variance

T, B, D = 6, 8, 3
SAMPLER, ETA = "sage_grpo", 0.7


def _setup(seed=0, sampler=SAMPLER):
    torch.manual_seed(seed)
    policy = VelocityMLP(D, hidden=16, depth=2)
    anchor = VelocityMLP(D, hidden=16, depth=2)
    sigmas = sigma_schedule(T, 3.0)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=gen)
    lat, lps = [x], []
    with torch.no_grad():
        for t in range(T):
            out = sde_step(sampler, policy(x, torch.full((B,), float(sigmas[t]))), x, float(sigmas[t]),
                           float(sigmas[t + 1]), ETA, sigma_max=sigmas[1], generator=gen)
            x = out.prev_sample
            lat.append(x)
            lps.append(out.log_prob)
    latents = torch.stack(lat)  # [T+1, B, D]
    # perturb the policy so that the ratio leaves 1 and clipping acts
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    adv = torch.randn(B, generator=gen)
    valid = torch.ones(B, dtype=torch.bool)
    valid[3] = False
    return policy, anchor, sigmas, latents, torch.stack(lps).T.contiguous(), adv, valid


def _step(model, sigmas, latents, i, t, sampler=SAMPLER):
    x_t, x_next = latents[t, i], latents[t + 1, i]
    s, s_next = sigmas[t].float(), sigmas[t + 1].float()
    return sde_step(sampler, model(x_t, s), x_t, s, s_next, ETA, sigma_max=sigmas[1], prev_sample=x_next)


def test_plan_steps_drops_deterministic_steps_and_counts():
    var = torch.tensor([1.0, 0.5, 0.2, 0.1, 0.0])  # the last step injects no noise (cps)
    assert torch.equal(stochastic_steps(var), torch.arange(4))
    plan = plan_steps(5, var, 0.5, permute=False)
    assert torch.equal(plan, torch.tensor([[0, 1]] * 5))  # ceil(4 * 0.5) = 2 of the stochastic steps, in order
    gens = [torch.Generator().manual_seed(s) for s in range(200)]
    plan = plan_steps(200, var, 0.75, permute=True, generators=gens)  # ceil(3) = 3 per sample
    assert plan.shape == (200, 3) and int(plan.max()) <= 3
    assert all(len(set(row.tolist())) == 3 for row in plan)  # no step twice in a sample
    assert len({tuple(r.tolist()) for r in plan}) > 10  # samples draw their own orders
    again = plan_steps(200, var, 0.75, permute=True, generators=[torch.Generator().manual_seed(s) for s in range(200)])
    assert torch.equal(plan, again)
    with pytest.raises(ValueError, match="eta"):
        plan_steps(2, torch.zeros(4), 1.0, permute=False)


def _reference_loss(policy, anchor, sigmas, latents, lps, adv, valid, plan, s_t, clip, coef, bp, bv):
    """The GRPO loss written out per pair: mean over valid pairs of the clipped surrogate times S_t plus
    coef * (bp * KL_pos + bv * KL_vel)."""
    var = step_variance(SAMPLER, sigmas[:-1], sigmas[1:], ETA, sigma_max=sigmas[1]).float()
    terms = []
    for i in range(B):
        if not valid[i]:
            continue
        for t in plan[i].tolist():
            new = _step(policy, sigmas, latents, torch.tensor([i]), torch.tensor([t]))
            with torch.no_grad():
                ref = _step(anchor, sigmas, latents, torch.tensor([i]), torch.tensor([t]))
            r = torch.exp(new.log_prob[0] - lps[i, t])
            pg = torch.maximum(-adv[i] * r, -adv[i] * r.clamp(1 - clip, 1 + clip)) * s_t[t]
            kl_pos = ((new.mean - ref.mean) ** 2).mean() / (2 * (var[t] + 1e-6))
            kl_vel = lps[i, t] - new.log_prob[0]
            terms.append(pg + coef * (bp * kl_pos + bv * kl_vel))
    return torch.stack(terms).mean()


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_gradient_matches_written_out_loss_for_any_micro_batch(chunk):
    policy, anchor, sigmas, latents, lps, adv, valid = _setup()
    var = step_variance(SAMPLER, sigmas[:-1], sigmas[1:], ETA, sigma_max=sigmas[1])
    plan = plan_steps(B, var, 0.5, permute=True, generators=torch.Generator().manual_seed(5))  # [B, 3]
    s_t = equalizer_weights(SAMPLER, sigmas, ETA)
    kw = dict(clip=0.02, coef=0.3, bp=1.0, bv=0.1)
    ref_loss = _reference_loss(policy, anchor, sigmas, latents, lps, adv, valid, plan, s_t, **kw)
    ref_grads = torch.autograd.grad(ref_loss, list(policy.parameters()))

    n_pairs = int(valid.sum()) * plan.shape[1]
    policy.zero_grad()
    total_pairs, total_masked = 0, 0
    for mb in micro_batches(plan, list(torch.arange(B).split(chunk))):
        st = grpo_backward(
            mb, lambda i, t: _step(policy, sigmas, latents, i, t), logp_old=lps, advantages=adv, valid=valid,
            step_weights=s_t, clip_range=kw["clip"], normalizer=n_pairs, kl_coef=kw["coef"], beta_pos=kw["bp"],
            beta_vel=kw["bv"], anchor_fn=lambda b: _step(anchor, sigmas, latents, b.samples, b.steps).mean,
        )
        total_pairs += st.pairs
        total_masked += st.masked_pairs
    assert (total_pairs, total_masked) == (n_pairs, plan.shape[1])  # the failed sample ran, with weight 0
    for g_ref, p in zip(ref_grads, policy.parameters()):
        torch.testing.assert_close(p.grad, g_ref, rtol=1e-5, atol=1e-7)
    assert any(float(g.abs().max()) > 0 for g in ref_grads)


def test_stats_are_pair_means_and_clipping_shows():
    policy, anchor, sigmas, latents, lps, adv, valid = _setup()
    var = step_variance(SAMPLER, sigmas[:-1], sigmas[1:], ETA, sigma_max=sigmas[1])
    plan = plan_steps(B, var, 1.0, permute=False)
    from sage_grpo.grpo import UpdateStats

    total = UpdateStats()
    for mb in micro_batches(plan, list(torch.arange(B).split(2))):
        total.merge(grpo_backward(mb, lambda i, t: _step(policy, sigmas, latents, i, t), logp_old=lps, advantages=adv,
                                  valid=valid, step_weights=torch.ones(T), clip_range=1e-3, normalizer=1.0))
    s = total.summary()
    with torch.no_grad():
        ratios = torch.stack([torch.exp(_step(policy, sigmas, latents, torch.arange(B), torch.full((B,), t)).log_prob
                                        - lps[:, t]) for t in range(T)])[:, valid]  # [T, B']
    assert s["train/ratio_min"] == pytest.approx(float(ratios.min()), rel=1e-5)
    assert s["train/ratio_max"] == pytest.approx(float(ratios.max()), rel=1e-5)
    assert s["train/ratio_mean"] == pytest.approx(float(ratios.mean()), rel=1e-5)
    assert s["train/clipfrac"] == pytest.approx(float(((ratios - 1).abs() > 1e-3).float().mean()), abs=1e-6)
    assert 0 < s["train/clipfrac"] <= 1
    assert "kl/pos" not in s and math.isfinite(s["train/loss"])


def test_a_nan_ratio_survives_the_merge_of_micro_batches():
    """A micro-batch whose ratios are NaN, merged before or after a finite one, leaves NaN extremes (builtin min and
    max dropped it when it came second: min(inf, nan) is inf), so the first-update check cannot read 1 over a NaN."""
    from sage_grpo.grpo import UpdateStats

    finite, broken = UpdateStats(pairs=2, ratio_min=1.0, ratio_max=1.0), UpdateStats(pairs=2, ratio_min=math.nan,
                                                                                     ratio_max=math.nan)
    for order in ((broken, finite), (finite, broken)):
        total = UpdateStats()
        for part in order:
            total.merge(part)
        s = total.summary()
        assert math.isnan(s["train/ratio_min"]) and math.isnan(s["train/ratio_max"])
    total = UpdateStats()
    total.merge(UpdateStats(pairs=1, ratio_min=0.9, ratio_max=1.1))
    total.merge(UpdateStats(pairs=1, ratio_min=0.95, ratio_max=1.2))
    assert (total.summary()["train/ratio_min"], total.summary()["train/ratio_max"]) == (0.9, 1.2)


def test_anchor_equal_to_policy_needs_no_forward_and_gives_the_same_gradient():
    policy, _, sigmas, latents, lps, adv, valid = _setup()
    anchor = VelocityMLP(D, hidden=16, depth=2)
    anchor.load_state_dict(policy.state_dict())
    var = step_variance(SAMPLER, sigmas[:-1], sigmas[1:], ETA, sigma_max=sigmas[1])
    plan = plan_steps(B, var, 1.0, permute=False)
    grads, kls = [], []
    for shortcut in (False, True):
        policy.zero_grad()
        calls = []

        def anchor_fn(b, calls=calls):
            calls.append(1)
            return _step(anchor, sigmas, latents, b.samples, b.steps).mean

        st = grpo_backward(PairBatch(torch.arange(B).repeat_interleave(T), plan.reshape(-1)),
                           lambda i, t: _step(policy, sigmas, latents, i, t), logp_old=lps, advantages=adv,
                           valid=valid, step_weights=torch.ones(T), clip_range=0.1, normalizer=10.0, kl_coef=5.0,
                           beta_pos=1.0, anchor_fn=anchor_fn, anchor_is_policy=shortcut)
        assert len(calls) == (0 if shortcut else 1)
        grads.append([p.grad.clone() for p in policy.parameters()])
        kls.append(st.summary()["kl/pos"])
    assert kls == [0.0, 0.0]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_precomputed_anchor_means_equal_anchor_callback():
    policy, anchor, sigmas, latents, lps, adv, valid = _setup()
    var = step_variance(SAMPLER, sigmas[:-1], sigmas[1:], ETA, sigma_max=sigmas[1])
    mb = micro_batches(plan_steps(B, var, 0.5, permute=False))[0]
    grads = []

    def anchor_mean(b):
        return _step(anchor, sigmas, latents, b.samples, b.steps).mean

    for pre in (False, True):
        policy.zero_grad()
        ref = anchor_mean(mb).detach() if pre else None
        b = PairBatch(mb.samples, mb.steps, ref_mean=ref)
        st = grpo_backward(b, lambda i, t: _step(policy, sigmas, latents, i, t), logp_old=lps, advantages=adv,
                           valid=valid, step_weights=torch.ones(T), clip_range=0.1, normalizer=3.0, kl_coef=2.0,
                           beta_pos=1.0, anchor_fn=None if pre else anchor_mean)
        assert st.summary()["kl/pos"] > 0
        grads.append([p.grad.clone() for p in policy.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def _global_updates(dp: int, per_rank: int, chunk: int, updates: int) -> list[list[int]]:
    """The global samples of each update of a round on `dp` ranks of `per_rank` videos (rank r holds the global
    samples r * per_rank ..), every rank's share in rank order."""
    out: list[list[int]] = [[] for _ in range(updates)]
    for r in range(dp):
        for u, chunks in enumerate(update_chunks(r * per_rank, per_rank, chunk, updates)):
            out[u] += [r * per_rank + int(i) for c in chunks for i in c]
    return out


@pytest.mark.parametrize("chunk,updates", [(2, 2), (1, 2), (1, 4), (2, 1)])
def test_a_round_splits_into_the_same_global_updates_on_any_number_of_ranks(chunk, updates):
    """Update u trains the global chunks g with g % updates == u, whatever the layout of the 8 videos; every rank
    takes the same number of chunks in each update (the ranks run the same forwards)."""
    want = [sorted(i for g in range(u, 8 // chunk, updates) for i in range(g * chunk, (g + 1) * chunk))
            for u in range(updates)]
    for dp in (1, 2, 4):
        per_rank = 8 // dp
        if per_rank % (chunk * updates):
            continue  # refused by config.validate
        assert [sorted(u) for u in _global_updates(dp, per_rank, chunk, updates)] == want, dp
        for r in range(dp):
            assert {len(c) for c in update_chunks(r * per_rank, per_rank, chunk, updates)} == {
                per_rank // (chunk * updates)}
    if (chunk, updates) == (2, 2):
        assert want == [[0, 1, 4, 5], [2, 3, 6, 7]]  # the rollout's chunks [0,1], [2,3], ... take turns


def test_a_split_that_cuts_a_chunk_is_refused():
    with pytest.raises(ValueError, match="whole chunks"):
        update_chunks(2, 4, 2, 2)  # a rank's first global chunk must start an update's turn
