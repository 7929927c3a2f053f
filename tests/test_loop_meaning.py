"""What post_train.py's loop means, not only that it is consistent with itself (issue 27 item 5).

The exact-resume tests compare the loop with itself, so a single-point change that keeps it deterministic (an update
N times too large, a schedule counted on the wrong clock, a plan or noise repeated every step, a KL term that never
reaches the loss, a held-out metric checked the wrong way) passes them. Each test here states a property of the
algorithm and checks it against a quantity computed independently (a bigger batch, the KL formula of
algorithm.md section 6, the update counter, the metric's sense). Each docstring says which deliberate break of the
code was seen to fail it. Everything runs in-process on the tiny random model (CPU, a few seconds each);
data-parallel ranks are simulated in one process by replacing the all-reduce, which is exact for two ranks.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from post_train_helpers import _args, pt

import sage_grpo.parallel.dist as dist_mod
from sage_grpo.config import Config, load_config
from sage_grpo.data import GroupSampler
from sage_grpo.hacking import REWARD, Summary
from sage_grpo.parallel.dist import DistInfo, sync_gradients
from sage_grpo.rollout import policy_step

# ------------------------------------------------------------------------------------------------------ helpers

SMALL = ("--batch_size", "2", "--num_generations", "2", "--timestep_fraction", "0.5")  # 2 videos x 2 trained steps


def _setup(model, out, *flags):
    """Components and a fresh TrainState of a one-process run of the tiny model (no validation, no checkpoint)."""
    cfg = load_config(_args(model, out, *flags), prog="post_train.py")
    return pt.setup(cfg, DistInfo(), None)


def _grads(c) -> list[torch.Tensor]:
    """Copies of the accumulated gradients of the trainable parameters (zeros where none arrived)."""
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in c.trainable]


def _record_updates(mp) -> list[dict]:
    """Wrap post_train.optimizer_step: record, per optimizer update, the gradients it receives (before the
    data-parallel sync and the norm clip, which would hide a wrong scale) and the counters at that moment."""
    seen, real = [], pt.optimizer_step

    def spy(c, state):
        seen.append({"grads": _grads(c), "step": state.step, "updates": state.updates})
        return real(c, state)

    mp.setattr(pt, "optimizer_step", spy)
    return seen


def _record(mp, name: str) -> list:
    """Wrap post_train.<name>: record what each call returned."""
    seen, real = [], getattr(pt, name)

    def spy(*a, **k):
        out = real(*a, **k)
        seen.append(out)
        return out

    mp.setattr(pt, name, spy)
    return seen


def _take(traj, idx):
    """The samples `idx` of a trajectory: what a rollout of just those videos stores (the noise is hash-seeded per
    video, so it does not depend on the batch a video was sampled in)."""
    idx = torch.as_tensor(list(idx))
    return replace(traj, latents=traj.latents[idx], log_probs=traj.log_probs[idx], prompt_ids=traj.prompt_ids[idx],
                   generation_ids=traj.generation_ids[idx], prompt_seeds=traj.prompt_seeds[idx],
                   prompts=[traj.prompts[i] for i in idx.tolist()], cond=traj.cond.index(idx),
                   uncond=None if traj.uncond is None else traj.uncond.index(idx))


def _assert_grads_close(got, want, what: str, rtol: float = 1e-4) -> None:
    """Every parameter's gradient equal up to float rounding (relative to the largest entry of the reference)."""
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 0, f"{what}: the reference gradient is zero, nothing is compared"
    worst = max(float((g - w).abs().max()) for g, w in zip(got, want))
    ratio = max(float(g.abs().max()) for g in got) / scale
    assert worst <= rtol * scale, (f"{what}: max |difference| {worst:.3g} vs max |reference| {scale:.3g} "
                                   f"(largest entries differ by a factor {ratio:.4g})")


# ------------------------------------------------------------------------------------------------------ accumulation


@pytest.fixture(scope="module")
def big_round(tiny_model, tmp_path_factory):
    """One rollout round of 8 videos (2 prompts x G 4) trained by `train` as one optimizer update: its trajectory,
    advantages, validity, plan and the gradient the update received."""
    with pytest.MonkeyPatch.context() as mp:
        updates = _record_updates(mp)
        trajs, rewards, plans = (_record(mp, n) for n in ("rollout_phase", "reward_phase", "plan_round"))
        c, state = _setup(tiny_model, tmp_path_factory.mktemp("big"), "--batch_size", "8", "--max_steps", "1")
        pt.train(c, state, final_save=False)
    (traj,), (plan,), (update,) = trajs, plans, updates
    ((adv, valid, _),) = rewards
    assert traj.batch_size == 8 and bool(valid.all()) and update["updates"] == 0
    return SimpleNamespace(traj=traj, adv=adv, valid=valid, plan=plan, grads=update["grads"])


def test_accumulated_update_equals_one_round_with_n_times_the_batch(tiny_model, tmp_path, monkeypatch, big_round):
    """gradient_accumulation_steps 2 with 4 videos per round accumulates the gradient of one round of 8 videos: the
    mean over all the update's pairs, not a sum of per-round means. The two rounds get the two halves (one group
    each) of the 8-video rollout, so the pairs are the same; every step is trained (timestep_fraction 1), so the
    plans' order does not matter.

    Seen failing when backward_phase's normalizer is not multiplied by gradient_accumulation_steps (an update N
    times too large): "accumulated over 2 rounds: max |difference| 0.00276 vs max |reference| 0.00276 (largest
    entries differ by a factor 2)"."""
    halves = [_take(big_round.traj, range(0, 4)), _take(big_round.traj, range(4, 8))]
    monkeypatch.setattr(pt, "rollout_phase", lambda c, state: halves[state.step])
    updates = _record_updates(monkeypatch)
    c, state = _setup(tiny_model, tmp_path, "--batch_size", "4", "--gradient_accumulation_steps", "2",
                      "--max_steps", "2")
    pt.train(c, state, final_save=False)
    assert [(u["step"], u["updates"]) for u in updates] == [(1, 0)]  # one update, after the second round
    _assert_grads_close(updates[0]["grads"], big_round.grads, "accumulated over 2 rounds", rtol=1e-5)


def _train_with_mask(model, out, mp, trajs: list, masks: list, *flags) -> list[torch.Tensor]:
    """Train len(trajs) rounds, round k on trajs[k] with its rewards' validity replaced by masks[k] -> the gradient
    of the one optimizer update."""
    mp.setattr(pt, "rollout_phase", lambda c, state: trajs[state.step])
    real, rounds = pt.reward_phase, []

    def reward_phase(c, traj, early=None):
        adv, _, metrics = real(c, traj, early)
        rounds.append(None)
        return adv, masks[len(rounds) - 1], metrics

    mp.setattr(pt, "reward_phase", reward_phase)
    updates = _record_updates(mp)
    c, state = _setup(model, out, "--max_steps", str(len(trajs)), *flags)
    pt.train(c, state, final_save=False)
    assert [u["updates"] for u in updates] == [0]
    return updates[0]["grads"]


def test_accumulated_rounds_with_unequal_valid_pairs_average_over_the_update(tiny_model, tmp_path, monkeypatch,
                                                                             big_round):
    """Two accumulated rounds of 4 videos where the second has 2 videos masked (a failed reward), so it has half the
    first's valid pairs: the update's gradient is the mean over all its valid pairs, the gradient of one round of
    the 8 videos with the same 2 masked, not the mean of the two rounds' own means.

    Seen failing when each round is divided by its own pair count x gradient_accumulation_steps: "unequal rounds:
    max |difference| 0.000713 vs max |reference| 0.00233 (largest entries differ by a factor 0.9155)"."""
    mask = torch.ones(8, dtype=torch.bool)
    mask[6:] = False
    with pytest.MonkeyPatch.context() as mp:
        one = _train_with_mask(tiny_model, tmp_path / "one", mp, [big_round.traj], [mask], "--batch_size", "8")
    halves = [_take(big_round.traj, range(0, 4)), _take(big_round.traj, range(4, 8))]
    two = _train_with_mask(tiny_model, tmp_path / "two", monkeypatch, halves, [mask[:4], mask[4:]],
                           "--batch_size", "4", "--gradient_accumulation_steps", "2")
    _assert_grads_close(two, one, "unequal rounds", rtol=1e-5)


def _simulate_two_ranks(mp, contributions: list) -> None:
    """Stand-in for all_reduce_sum on rank 0 of a 2-rank world: adds what the other rank contributes to each call,
    in call order (exactly what a 2-rank sum gives)."""
    queue = list(contributions)

    def all_reduce_sum(t, group=None):
        return t.add_(queue.pop(0).to(t.dtype))

    mp.setattr(dist_mod, "all_reduce_sum", all_reduce_sum)


def test_data_parallel_ranks_average_to_the_one_process_gradient(tiny_model, tmp_path, monkeypatch, big_round):
    """Two data-parallel ranks with 4 videos each end, after `sync_gradients`, with the gradient of one process
    training all 8: each rank's loss is normalised by the global pair count over dp, and the sync sums the ranks'
    gradients and divides by dp (an average, not a sum). The all-reduce is simulated in one process: rank 0's call
    adds rank 1's tensor. Each rank's trained steps are also the one-process plan's rows for its videos.

    Seen failing when sync_gradients does not divide by dp (sums the ranks): "2 data-parallel ranks after sync:
    max |difference| 0.00276 vs max |reference| 0.00276 (largest entries differ by a factor 2)"; when
    backward_phase's normalizer is not divided by dp: "... max |difference| 0.00138 vs max |reference| 0.00276
    (largest entries differ by a factor 0.5)"."""
    c, state = _setup(tiny_model, tmp_path, "--batch_size", "4", "--max_steps", "1")
    per_rank = []
    for r in range(2):
        cr = replace(c, info=DistInfo(rank=r, world_size=2))
        rows = slice(4 * r, 4 * r + 4)
        half = _take(big_round.traj, range(rows.start, rows.stop))
        plan = pt.plan_round(cr, state, half)
        agree = torch.equal(plan, big_round.plan[rows])
        assert agree, f"rank {r} trains other steps than one process would"
        other = big_round.valid[slice(4, 8) if r == 0 else slice(0, 4)]
        with monkeypatch.context() as mp:
            # the other rank's pairs: none from earlier rounds, its valid videos x trained steps in this one
            _simulate_two_ranks(mp, [torch.tensor([0.0, float(other.sum()) * plan.shape[1]])])
            pt.backward_phase(cr, state, half, big_round.adv[rows], big_round.valid[rows],
                              pt.micro_batches_of(cr, plan)[0])
        per_rank.append(_grads(c))
        c.optimizer.zero_grad(set_to_none=True)
    for p, g in zip(c.trainable, per_rank[0]):
        p.grad = g.clone()
    with monkeypatch.context() as mp:
        _simulate_two_ranks(mp, per_rank[1])  # one all-reduce per parameter, in c.trainable's order
        sync_gradients(c.trainable, DistInfo(rank=0, world_size=2), fsdp=False)
    _assert_grads_close(_grads(c), big_round.grads, "2 data-parallel ranks after sync")


# ------------------------------------------------------------------------------------------------------ KL term


def _kl_loss(c, traj, mbs, anchor, beta_pos: float, beta_vel: float) -> torch.Tensor:
    """L_KL of algorithm.md section 6, written out from the formulas: mean over the trained pairs of
    beta_pos * KL_pos + beta_vel * KL_vel, KL_pos = mean over elements of (mean_theta - mean_ref)^2 / (2 (V_t + 1e-6))
    with the anchor's means at the same x_t, KL_vel = logp_old - logp_new. Re-scored in the update's micro-batches,
    so that the float rounding of each forward matches."""
    tokens = c.pipe.vision_num_semantic_tokens
    total, pairs = 0.0, 0
    for mb in mbs:
        with torch.no_grad():
            ref = policy_step(anchor, traj, mb.samples, mb.steps, tokens).mean
        out = policy_step(c.transformer, traj, mb.samples, mb.steps, tokens)
        var = c.variance[mb.steps].reshape(-1, *[1] * (ref.ndim - 1))
        kl_pos = ((out.mean - ref) ** 2 / (2 * (var + 1e-6))).flatten(1).mean(dim=1)
        kl_vel = traj.log_probs[mb.samples, mb.steps] - out.log_prob
        total = total + (beta_pos * kl_pos + beta_vel * kl_vel).sum()
        pairs += len(mb.samples)
    return total / pairs


def test_kl_term_reaches_the_gradient_with_its_coefficient(tiny_model, tmp_path):
    """After one update (the policy has left the anchor, the initial model, so both KL terms are non-zero), the
    update's gradient with lambda_KL on minus the one with lambda_KL = 0 is lambda_KL times the gradient of L_KL
    computed here from the formulas (dual KL, beta_pos 1, beta_vel 0.1), and the logged kl/loss is that L_KL.

    Seen failing when grpo_backward leaves `kl_coef * kl_total` out of the loss while still logging the KL
    statistics, and when backward_phase passes kl_coef=0.0: "KL on - KL off: max |difference| 0.00198 vs max
    |reference| 0.00198 (largest entries differ by a factor 0)"."""
    c, state = _setup(tiny_model, tmp_path, *SMALL, "--max_steps", "1", "--learning_rate", "1e-2")
    anchor = copy.deepcopy(c.transformer).requires_grad_(False)  # the anchor until its first refresh (update 2)
    pt.train(c, state, final_save=False)
    assert state.updates == 1 and not state.anchor_synced
    traj = pt.rollout_phase(c, state)
    adv, valid, _ = pt.reward_phase(c, traj)
    (mbs,) = pt.anchor_means(c, state, traj, pt.micro_batches_of(c, pt.plan_round(c, state, traj)))
    lam = 1e-3  # lambda * grad L_KL (~2e-3) is then a sizable part of the gradient (~1e-2): neither hides the other

    def update_grads(coef):
        c.optimizer.zero_grad(set_to_none=True)
        state.controller.value = coef
        stats = pt.backward_phase(c, state, traj, adv, valid, mbs)
        return _grads(c), stats

    on, stats = update_grads(lam)
    off, _ = update_grads(0.0)
    c.optimizer.zero_grad(set_to_none=True)
    loss = _kl_loss(c, traj, mbs, anchor, beta_pos=1.0, beta_vel=0.1)
    expected = torch.autograd.grad(loss, c.trainable, allow_unused=True)
    expected = [torch.zeros_like(p) if g is None else lam * g for p, g in zip(c.trainable, expected)]
    assert stats.sums["kl/pos"] > 0 and stats.sums["kl/loss"] / stats.pairs == pytest.approx(loss.item(), rel=1e-4)
    _assert_grads_close([a - b for a, b in zip(on, off)], expected, "KL on - KL off", rtol=1e-3)


# ------------------------------------------------------------------------------------------------------ schedules


def test_lr_warmup_and_kl_controller_count_optimizer_updates_under_accumulation(tiny_model, tmp_path, monkeypatch):
    """With 2 rounds per update, 4 rounds make 2 updates: the learning rate warms up per update (lr_at(k), k = 0,
    1 updates done: peak/4, 2 peak/4), and the KL coefficient is the one of the updates done, the same for both
    rounds of an update (lambda(k) = kl_coef + (kl_weight - kl_coef) k / K, K = 4), moving once per update.

    Seen failing when optimizer_step takes lr_at(state.step, ...) (rollout rounds) instead of state.updates:
    "[0.0005, 0.001] != [0.00025, 0.0005]"; and when the controller moves after every round (train calling
    state.controller.update after each backward_phase instead of optimizer_step once per update):
    "assert (4, 2, 4) == (4, 2, 2)"."""
    lrs, coefs = [], []
    c, state = _setup(tiny_model, tmp_path, *SMALL, "--gradient_accumulation_steps", "2", "--max_steps", "4",
                      "--learning_rate", "1e-3", "--warmup_steps", "4", "--kl_weight", "1e-5", "--kl_coef", "1e-7",
                      "--kl_min_coef", "1e-7", "--kl_warmup_updates", "4")
    real_step, real_backward = c.optimizer.step, pt.backward_phase

    def step():
        lrs.append(c.optimizer.lr)  # what the optimizers actually use for this update
        real_step()

    def backward(c, state, *a, **k):
        coefs.append(state.controller.value)  # what this round's loss is weighted with
        return real_backward(c, state, *a, **k)

    monkeypatch.setattr(c.optimizer, "step", step)
    monkeypatch.setattr(pt, "backward_phase", backward)
    pt.train(c, state, final_save=False)
    assert (state.step, state.updates, state.controller.num_updates) == (4, 2, 2)
    assert lrs == pytest.approx([1e-3 / 4, 2e-3 / 4], rel=1e-12), f"{lrs} != [0.00025, 0.0005]"
    lam = [1e-7 + (1e-5 - 1e-7) * k / 4 for k in range(3)]
    assert coefs == pytest.approx([lam[0], lam[0], lam[1], lam[1]], rel=1e-9)
    assert state.controller.value == pytest.approx(lam[2], rel=1e-9)


def test_kl_controller_sees_each_updates_own_mean_kl(tiny_model, tmp_path, monkeypatch):
    """With 2 rounds per update and a fixed anchor, 6 rounds make 3 updates; the controller is called once per
    update with the mean L_KL over that update's pairs (both of its rounds): the first update 0 (the policy is
    the anchor), the later ones > 0, each its own rounds' mean, computed here from what backward_phase returned.

    Seen failing when optimizer_step does not reset the pending KL sum after an update (the controller sees a
    cumulative, growing KL): "update 2: the controller saw 4.03, the update's mean L_KL is 3.1"."""
    c, state = _setup(tiny_model, tmp_path, *SMALL, "--gradient_accumulation_steps", "2", "--max_steps", "6",
                      "--learning_rate", "1e-2", "--kl_weight", "1e-5", "--use_moving_KL", "False")
    rounds = _record(monkeypatch, "backward_phase")
    seen, real_update = [], state.controller.update

    def update(kl):
        seen.append(kl)
        real_update(kl)

    monkeypatch.setattr(state.controller, "update", update)
    pt.train(c, state, final_save=False)
    assert (state.step, state.updates, len(rounds), len(seen)) == (6, 3, 6, 3)
    own = [sum(r.sums["kl/loss"] for r in rounds[2 * k : 2 * k + 2]) / sum(r.pairs for r in rounds[2 * k : 2 * k + 2])
           for k in range(3)]
    assert own[0] == 0.0 and own[1] > 0 and own[2] > 0
    for k in range(3):
        assert seen[k] == pytest.approx(own[k], rel=1e-12, abs=0.0), (
            f"update {k}: the controller saw {seen[k]:.3g}, the update's mean L_KL is {own[k]:.3g}")


# ------------------------------------------------------------------------------------------------------ randomness


def _plan_context(info: DistInfo):
    """What plan_round reads: the seed, the trained fraction (half of 8 noisy steps) with permutation, the rank."""
    cfg = Config()
    cfg.optim.timestep_fraction, cfg.optim.enable_timestep_permutation = 0.5, True
    return SimpleNamespace(cfg=cfg, info=info, variance=torch.ones(8), windows=torch.ones(1, 8, dtype=torch.bool))


def _plan(info: DistInfo, step: int, videos: int) -> torch.Tensor:
    return pt.plan_round(_plan_context(info), SimpleNamespace(step=step),
                         SimpleNamespace(batch_size=videos, sde_steps=torch.ones(8, dtype=torch.bool)))


def test_trained_steps_vary_per_step_and_sample_and_agree_across_ranks():
    """Each rollout round trains other (sample, step) pairs: the plans of 6 consecutive steps all differ, and the
    samples of a step draw their own orders. Across ranks: the two data-parallel ranks' plans (4 videos each) are
    the rows of one process's plan of 8 videos, and the sequence-parallel peers of a rank (which run their forwards
    together) get the same plan.

    Seen failing when plan_round seeds its generators without state.step (derive_seed(seed, 0, video, ...)):
    "steps 0 and 1 train the same pairs"; and when it numbers the videos by rank instead of dp_rank: "step 0:
    sequence-parallel peers (dp 2 x sp 2) train different steps"."""
    one = DistInfo()
    plans = [_plan(one, s, 4) for s in range(6)]
    for a in range(6):
        assert plans[a].shape == (4, 4)
        assert len({tuple(r) for r in plans[a].tolist()}) > 1, f"every sample of step {a} trains the same steps"
        for b in range(a):
            same = torch.equal(plans[a], plans[b])
            assert not same, f"steps {b} and {a} train the same pairs"
    for s in (0, 3):
        whole = _plan(one, s, 8)
        dp = [_plan(DistInfo(rank=r, world_size=2), s, 4) for r in range(2)]
        agree = torch.equal(torch.cat(dp), whole)
        assert agree, f"step {s}: the 2 data-parallel ranks' plans are not the rows of one process's plan"
        sp = [_plan(DistInfo(rank=r, world_size=4, sp_size=2), s, 4) for r in range(4)]
        agree = torch.equal(sp[0], sp[1]) and torch.equal(sp[2], sp[3]) and torch.equal(torch.cat(sp[::2]), whole)
        assert agree, f"step {s}: sequence-parallel peers (dp 2 x sp 2) train different steps"


def test_each_update_of_a_round_trains_the_same_videos_on_any_number_of_ranks():
    """--updates_per_rollout 2, chunks of 2: the round's updates train the same global videos on 2 ranks x 4 videos
    (and 2 x 2 sp peers) as on one process of 8, so a resume on another layout continues exactly.

    Seen failing when micro_batches_of splits each rank's own chunks in halves: "2 data-parallel ranks train
    [[0, 1, 4, 5], [2, 3, 6, 7]], one process [[0, 1, 2, 3], [4, 5, 6, 7]]"."""
    optim = SimpleNamespace(mini_batch_size_per_update=2, updates_per_rollout=2)

    def trained(info: DistInfo, b: int) -> list[list[int]]:  # the global videos of each update, over the dp ranks
        out: list[list[int]] = [[], []]
        ranks = {i.dp_rank: i for i in (DistInfo(rank=r, world_size=info.world_size, sp_size=info.sp_size)
                                         for r in range(info.world_size))}
        for dp_rank, rank_info in sorted(ranks.items()):
            c = SimpleNamespace(cfg=SimpleNamespace(optim=optim), info=rank_info)
            plan = torch.zeros(b, 1, dtype=torch.long)  # [b, k]: the steps do not matter here
            for u, mbs in enumerate(pt.micro_batches_of(c, plan)):
                out[u] += [dp_rank * b + int(i) for mb in mbs for i in mb.samples]
        return [sorted(u) for u in out]

    one = trained(DistInfo(), 8)
    for info in (DistInfo(rank=0, world_size=2), DistInfo(rank=0, world_size=4, sp_size=2)):
        two = trained(info, 4)
        assert two == one, f"{info.dp_size} data-parallel ranks train {two}, one process {one}"
    assert one == [[0, 1, 4, 5], [2, 3, 6, 7]]  # the rollout's chunks take turns


def _standard_noise(c, traj) -> torch.Tensor:
    """The standard normal draws xi of every transition, (x_{t+1} - mean_t) / std_t -> [B, T, ...], recovered by
    re-scoring the stored transitions (the weights are those of the rollout)."""
    tokens = c.pipe.vision_num_semantic_tokens
    out = []
    with torch.no_grad():
        for t in range(traj.num_steps):
            i = torch.arange(traj.batch_size)
            step = policy_step(c.transformer, traj, i, t, tokens)
            std = step.std.reshape(-1, *[1] * (step.mean.ndim - 1))
            out.append((traj.latents[:, t + 1] - step.mean) / std)
    return torch.stack(out, dim=1)


def test_rollout_noise_and_prompts_vary_per_step(tiny_model, tmp_path):
    """Consecutive steps sample other prompts; and the same prompts sampled at two steps (the prompt stream rewound)
    start from other noise and draw other SDE noise at every transition, while the G videos of a group draw their
    own noise within a step. A video's trajectory does not depend on the rank that samples it.

    Seen failing when rollout_phase passes a constant base_seed (derive_seed(seed, 0) instead of
    derive_seed(seed, state.step)): "step 1 starts from the noise of step 0"; when rollout seeds the SDE noise
    without the base seed: "transition 0: steps 0 and 1 draw the same SDE noise"; when it seeds it without the
    generation index: "videos 0 and 1 of a group draw the same SDE noise"; when rollout_phase mixes the rank
    into the base seed (derive_seed(seed, step, dp_rank)): "dp rank 1 samples other videos than one process does
    for the same positions"."""
    c, state = _setup(tiny_model, tmp_path, "--max_steps", "1")
    first = pt.rollout_phase(c, state)
    state.step = 1
    assert pt.rollout_phase(c, state).prompts != first.prompts  # the loop moves on through the prompts
    state.sampler.load_state_dict({"epoch": 0, "position": 0})  # the same prompts again, at step 1
    again = pt.rollout_phase(c, state)
    assert again.prompts == first.prompts
    same = torch.equal(again.latents[:, 0], first.latents[:, 0])
    assert not same, "step 1 starts from the noise of step 0"
    xi_first, xi_again = _standard_noise(c, first), _standard_noise(c, again)
    for t in range(first.num_steps):
        same = torch.allclose(xi_again[:, t], xi_first[:, t], atol=1e-3)
        assert not same, f"transition {t}: steps 0 and 1 draw the same SDE noise"
    for a in range(first.batch_size):  # the G = 4 videos of the group
        for b in range(a):
            same = torch.allclose(xi_first[a], xi_first[b], atol=1e-3)
            assert not same, f"videos {b} and {a} of a group draw the same SDE noise"
    assert float(xi_first.std()) == pytest.approx(1.0, abs=0.1)  # the recovered draws are standard normal
    # what must not vary: a video's noise, whichever rank samples it (dp rank 1 of 2 samples videos 2 and 3)
    rank1 = replace(c, info=DistInfo(rank=1, world_size=2))
    sampler = GroupSampler(len(c.prompts), batch_size=2, num_generations=4, dp_size=2, seed=c.cfg.optim.seed)
    half = pt.rollout_phase(rank1, SimpleNamespace(step=0, updates=0, sampler=sampler))
    same = half.prompts == first.prompts[2:] and torch.equal(half.latents, first.latents[2:])
    assert same, "dp rank 1 samples other videos than one process does for the same positions"


def test_a_prompt_drawn_twice_in_a_step_is_two_groups_with_their_own_noise(tiny_model, tmp_path):
    """A step of 2 groups from a prompt file of one prompt draws it twice (as an epoch boundary inside a step or a
    small image-size bucket can): the two groups start from other noise and draw other SDE noise at every
    transition, so the step trains two groups rather than one group twice.

    Seen failing when rollout_phase seeds the noise by the prompt alone, without the group's position in the step
    (prompt_seeds = record_noise_seed(rec)): "videos 0 and 2 (generation 0 of groups 0 and 1) start from the same
    noise"."""
    one = tmp_path / "one.txt"
    one.write_text("a red ball rolls\n")
    c, state = _setup(tiny_model, tmp_path / "run", "--batch_size", "4", "--num_generations", "2",
                      "--train_video_csv", str(one), "--max_steps", "1")
    traj = pt.rollout_phase(c, state)
    assert traj.prompts == ["a red ball rolls"] * 4 and traj.prompt_ids.tolist() == [0, 0, 1, 1]
    xi = _standard_noise(c, traj)
    for a, b in ((0, 2), (1, 3)):  # the same generation of the two groups
        same = torch.equal(traj.latents[a, 0], traj.latents[b, 0])
        assert not same, f"videos {a} and {b} (generation {a} of groups 0 and 1) start from the same noise"
        for t in range(traj.num_steps):
            same = torch.allclose(xi[a, t], xi[b, t], atol=1e-3)
            assert not same, f"transition {t}: videos {a} and {b} draw the same SDE noise"


def test_prompt_order_varies_per_epoch_and_agrees_across_ranks():
    """The sampler visits every prompt once per epoch, in an order drawn per epoch; two data-parallel ranks, each
    computing the plan alone, take complementary halves of the one-process step's videos (the same groups).

    Seen failing when GroupSampler._permutation seeds its generator without the epoch: "epochs 0 and 1 visit the
    prompts in the same order"."""
    sampler = GroupSampler(8, batch_size=4, num_generations=2, dp_size=1, seed=3)  # 2 prompts per step
    epochs = [sum((sampler.next_step() for _ in range(4)), []) for _ in range(3)]
    for e, order in enumerate(epochs):
        assert sorted(order) == list(range(8)), f"epoch {e} does not visit every prompt once"
    for a in range(3):
        for b in range(a):
            assert epochs[a] != epochs[b], f"epochs {b} and {a} visit the prompts in the same order"
    ranks = [GroupSampler(8, batch_size=2, num_generations=2, dp_size=2, seed=3) for _ in range(2)]
    one = GroupSampler(8, batch_size=4, num_generations=2, dp_size=1, seed=3)
    for _ in range(5):
        prompts = one.next_step()
        assert [s.next_step() for s in ranks] == [prompts, prompts]
        assert ranks[0].rank_slice(prompts, 0) + ranks[1].rank_slice(prompts, 1) == one.rank_slice(prompts, 0)


# ------------------------------------------------------------------------------------------------------ hacking


WORLD_CAPTION = "a large red square moves right on a blue background"
# the sense each held-out metric must have, written out here rather than read from the code: +1 higher is better
# (a fall warns), 0 no better side (a move either way warns), None never checked
EXPECTED_SENSES = {
    "brightness": 1,  # a component of the trained reward that --reward_weights does not weight
    "temporal_consistency": 1,  # a validation-only reward (sage_grpo/rewards: higher = steadier)
    "saturation": 0, "contrast": 0, "motion": 0,  # pixel statistics (brightness is reported as the component)
    # sage_grpo/world/metrics.py: every world metric is higher = better
    **{f"world_{m}": 1 for m in ("shape_fidelity", "background_cleanliness", "temporal_consistency",
                                 "object_persistence", "caption_agreement", "caption_background", "caption_color",
                                 "caption_shape", "caption_size", "caption_motion")},
    "drift": None,  # grows in every run that learns: reported, never checked
}


def _heldout():
    from sage_grpo.heldout import HeldOut, parse_validation_metrics
    from sage_grpo.rewards import build_reward

    spec = parse_validation_metrics(["components", "statistics", "world", "drift", "temporal_consistency"],
                                    ["brightness", "color"], [WORLD_CAPTION])
    trained = build_reward("brightness,color", reward_weights='{"color": 1}')
    extra = build_reward("temporal_consistency", reward_weights={"temporal_consistency": 1.0})
    return HeldOut(spec, trained, {"temporal_consistency": extra})


def _warned_after(c, metric: str, move: float) -> list[str]:
    """A fresh run's two validations through post_train.watch_hacking: the second has the trained reward up 10
    spreads and `metric` moved by `move` spreads, everything else unchanged -> the metrics warned about."""
    base = {REWARD: Summary(0.5, 0.01), **{k: Summary(0.4, 0.01) for k in c.heldout.names}}
    state = SimpleNamespace(val_first={}, hacking_warned={})
    pt.watch_hacking(c, state, 0, base)
    now = {**base, REWARD: Summary(0.6, 0.01), metric: Summary(0.4 + 0.01 * move, 0.01)}
    pt.watch_hacking(c, state, 2, now)
    return list(state.hacking_warned)


def test_every_held_out_metric_warns_in_its_own_direction():
    """Each held-out metric validation reports (trained-reward component, validation-only reward, statistics,
    every world metric, drift), through post_train.watch_hacking with the default thresholds: while the reward
    rises, a fall of a higher-is-better metric warns and its rise does not; a statistic warns either way; drift
    never.

    Seen failing when heldout.HeldOut gives the world metrics sense -1 (a fall in shape fidelity no longer warns):
    "world_shape_fidelity fell 3 spreads: warned [], want ['world_shape_fidelity']"."""
    c = SimpleNamespace(heldout=_heldout(), cfg=Config(), info=DistInfo())
    assert sorted(c.heldout.senses) == sorted(EXPECTED_SENSES)
    for metric, sense in EXPECTED_SENSES.items():
        for move, word in ((-3.0, "fell"), (3.0, "rose")):
            wrong = sense == 0 or (sense is not None and sense * move < 0)
            warned = _warned_after(c, metric, move)
            assert warned == ([metric] if wrong else []), \
                f"{metric} {word} 3 spreads: warned {warned}, want {[metric] if wrong else []}"


def test_a_degraded_world_video_warns_about_the_world_metrics_it_lowers():
    """The senses match what the world metrics measure: a rendered clip of its caption is at the top of every world
    metric, the same clip with pixel noise is lower on some (shape fidelity among them) and higher on none, and
    when validation goes from the clean clip to the noisy one while the reward rises, every world metric that fell
    warns (HeldOut.score -> post_train.watch_hacking).

    Seen failing when heldout.HeldOut gives the world metrics sense -1: "world metrics fell ['world_shape_fidelity',
    ...] but warned []"; and when world.metrics.shape_fidelity returns 1 - its score: "higher on the noisy clip:
    ['world_shape_fidelity']"."""
    from sage_grpo.world.render import render_caption

    c = SimpleNamespace(heldout=_heldout(), cfg=Config(), info=DistInfo())
    clean = render_caption(WORLD_CAPTION, seed=0)  # [F, 3, H, W]
    noisy = (clean + 0.25 * torch.randn(clean.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)

    def summaries(frames, reward):  # one validation video: its values, spread 0 (hacking floors it)
        held = c.heldout.score(frames, WORLD_CAPTION, {"total": reward, "brightness": 0.5, "color": reward}, None)
        return {REWARD: Summary(reward, 0.0), **{k: Summary(v, 0.0) for k, v in held.items()}}

    first, now = summaries(clean, 0.5), summaries(noisy, 0.6)
    world = [k for k in c.heldout.names if k.startswith("world_")]
    higher = [k for k in world if now[k].mean > first[k].mean]
    fell = [k for k in world if now[k].mean < first[k].mean]
    assert not higher, f"higher on the noisy clip: {higher}"
    assert "world_shape_fidelity" in fell
    state = SimpleNamespace(val_first={}, hacking_warned={})
    pt.watch_hacking(c, state, 0, first)
    pt.watch_hacking(c, state, 2, now)
    warned = [k for k in state.hacking_warned if k.startswith("world_")]
    assert sorted(warned) == sorted(fell), f"world metrics fell {fell} but warned {warned}"
