"""SDE windows and the shared ODE prefix (issue "Cheaper steps"): where the window sits, what the rollout does
inside and outside it, the equalizer over the window, the prefix computed once per prompt, and training through
post_train.py (first ratio 1, only window steps trained, a sliding window resumed exactly)."""

import pytest
import torch
from helpers import TINY_FRAMES, TINY_H, TINY_W
from post_train_helpers import ROOT

from sage_grpo.config import load_config
from sage_grpo.equalizer import equalizer_weights, gradient_scale
from sage_grpo.errors import SageGRPOError
from sage_grpo.rollout import SamplerSettings, latent_shape, policy_step, predict_velocity, rollout
from sage_grpo.schedule import sigma_schedule
from sage_grpo.window import prefix_steps, window_bounds, window_mask, window_positions


def test_window_positions_slide_and_roll_back_whole():
    # T = 8, window of 3 from step 1 moving by 2: [1, 4), [3, 6), [5, 8); then back to [1, 4) (MixGRPO's roll back)
    assert window_positions(8, 1, 3, 2) == [1, 3, 5]
    seen = [window_bounds(8, 1, 3, 2, every=2, update=u) for u in range(8)]
    assert seen == [(1, 4), (1, 4), (3, 6), (3, 6), (5, 8), (5, 8), (1, 4), (1, 4)]
    assert window_bounds(8, 2, 0, 0, every=1, update=5) == (2, 8)  # size 0: to the end, fixed
    assert window_bounds(8, 0, 0, 0, every=1, update=3) == (0, 8)  # the paper: every step
    assert window_mask(5, 1, 3).tolist() == [False, True, True, False, False]
    assert prefix_steps(window_mask(5, 2, 4)) == 2 and prefix_steps(window_mask(5, 0, 5)) == 0
    with pytest.raises(ValueError, match="not inside"):
        window_positions(8, 6, 3, 0)


@pytest.mark.parametrize("argv, message", [
    (["--sde_window_start", "8"], r"the SDE window \[8, 8\) is not inside the 8 steps"),
    (["--sde_window_start", "6", "--sde_window_size", "3"], r"the SDE window \[6, 9\) is not inside"),
    (["--sde_window_stride", "1"], "needs --sde_window_size"),
    (["--sde_window_size", "8", "--sde_window_stride", "1"], "cannot slide"),
    (["--sde_window_every", "0"], "--sde_window_every must be >= 1"),
    (["--sde_type", "cps", "--sde_window_start", "7"], "holds only cps's last step"),
    (["--sde_window_size", "2", "--timestep_fraction", "0.4"], r"int\(2 x 0.4\) = 0 of the 2 noisy steps of the "
                                                                "SDE window"),
    (["--sde_window_start", "2", "--shared_prefix", "True"], "--shared_prefix needs --use_same_noise"),
    (["--use_same_noise", "True", "--shared_prefix", "True"], "--shared_prefix needs --sde_window_start >= 1"),
])
def test_senseless_windows_are_refused_in_one_line(argv, message):
    with pytest.raises(SageGRPOError, match=message):
        load_config(["--config", str(ROOT / "configs/tiny_cpu.yaml"), *argv])


def test_equalizer_normalises_over_the_window():
    sigmas = sigma_schedule(10, 5.0)
    n = gradient_scale("sage_grpo", sigmas, 0.7)  # [10]
    window = window_mask(10, 1, 5)
    ranked = sorted(n[1:5].tolist())
    median = ranked[(len(ranked) - 1) // 2]  # torch.median's lower middle of an even count
    s = equalizer_weights("sage_grpo", sigmas, 0.7, steps=window)
    torch.testing.assert_close(s, (median / (n + 1e-8)).float())
    full = equalizer_weights("sage_grpo", sigmas, 0.7)
    assert not torch.allclose(s[1:5], full[1:5])  # the window's median is not the schedule's


PROMPT = "a red ball rolls"


def _rollout(pipe, cache, settings, *, g=3, **kw):
    """One group of g samples of PROMPT (one prompt id)."""
    return rollout(
        pipe.transformer, cache.get([PROMPT] * g), cache.get([""]), prompts=[PROMPT] * g,
        prompt_ids=torch.zeros(g, dtype=torch.long), generation_ids=torch.arange(g),
        prompt_seeds=torch.full((g,), 5), latent_shape=latent_shape(pipe.vae.config, TINY_FRAMES, TINY_H, TINY_W),
        settings=settings, image_tokens=pipe.vision_num_semantic_tokens, base_seed=3, **kw)


def test_steps_outside_the_window_are_ode_steps_without_log_prob(tiny_pipe, text_cache):
    s = SamplerSettings(sde_type="sage_grpo", eta=0.7, num_steps=5, cfg_scale=4.0)
    window = window_mask(5, 1, 3)  # SDE at steps 1, 2
    traj = _rollout(tiny_pipe, text_cache, s, g=2, sde_steps=window, same_noise=True)
    assert torch.isnan(traj.log_probs[:, [0, 3, 4]]).all() and torch.isfinite(traj.log_probs[:, 1:3]).all()
    assert torch.equal(traj.sde_steps, window)
    # every step outside the window is the Euler step x + (sigma' - sigma) v, computed here independently
    n = tiny_pipe.vision_num_semantic_tokens
    cond, unc = text_cache.get([PROMPT] * 2), text_cache.get(["", ""])
    for i in (0, 3, 4):
        x = traj.latents[:, i]
        v = predict_velocity(tiny_pipe.transformer, x, traj.sigmas[[i, i]], cond, unc, s, n)
        euler = x + (traj.sigmas[i + 1] - traj.sigmas[i]).float() * v
        torch.testing.assert_close(traj.latents[:, i + 1], euler, rtol=0, atol=1e-6)
    # deterministic: the samples of a group share x_0 and are equal until the window's noise separates them
    assert torch.equal(traj.latents[0, 1], traj.latents[1, 1])
    assert not torch.equal(traj.latents[0, 2], traj.latents[1, 2])
    # the window's steps re-score to ratio 1
    for i in (1, 2):
        out = policy_step(tiny_pipe.transformer, traj, torch.arange(2), i, n)
        assert torch.equal(torch.exp(out.log_prob - traj.log_probs[:, i]), torch.ones(2))


def _count_forwards(transformer):
    seen = []
    hook = transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["hidden_states"].shape[0]),
                                                 with_kwargs=True)
    return seen, hook


@pytest.mark.parametrize("chunk", [0, 1])
def test_shared_prefix_equals_g_separate_prefixes_with_fewer_forwards(tiny_pipe, text_cache, chunk):
    s = SamplerSettings(sde_type="flow_grpo", eta=0.7, num_steps=5, cfg_scale=4.0)
    window = window_mask(5, 3, 5)  # prefix: steps 0, 1, 2
    seen, hook = _count_forwards(tiny_pipe.transformer)
    try:
        separate = _rollout(tiny_pipe, text_cache, s, sde_steps=window, same_noise=True, chunk_size=chunk)
        n_separate = sum(seen)
        seen.clear()
        shared = _rollout(tiny_pipe, text_cache, s, sde_steps=window, same_noise=True, chunk_size=chunk,
                          share_prefix=True)
        n_shared = sum(seen)
        seen.clear()
        # a rank with fewer prompts than another repeats its last prefix call (FSDP2: the same forwards everywhere)
        padded = _rollout(tiny_pipe, text_cache, s, sde_steps=window, same_noise=True, chunk_size=chunk,
                          share_prefix=True, agree_calls=lambda k: k + 1)
        n_padded = sum(seen)
    finally:
        hook.remove()
    # the same numbers up to float rounding: the prefix runs on a batch of 1 instead of 3 (a matmul's rounding
    # depends on its batch); the samples of the separate run agree through the prefix to rounding (not bitwise:
    # with several torch threads the rows of one batch may be summed in other orders)
    for j in (1, 2):
        torch.testing.assert_close(separate.latents[j, :4], separate.latents[0, :4], rtol=0, atol=1e-5)
    torch.testing.assert_close(shared.latents, separate.latents, rtol=0, atol=1e-5)
    torch.testing.assert_close(shared.log_probs, separate.log_probs, rtol=0, atol=1e-5, equal_nan=True)
    assert torch.equal(padded.latents, shared.latents)
    # per-sample forwards (x2 for CFG): the prefix once for the prompt instead of 3 times
    assert n_separate == 2 * 5 * 3 and n_shared == 2 * (3 * 1 + 2 * 3) and n_padded == n_shared + 2 * 3
    with pytest.raises(ValueError, match="needs same_noise"):
        _rollout(tiny_pipe, text_cache, s, sde_steps=window, share_prefix=True)


def test_shared_prefix_gives_each_prompt_its_own_prefix(tiny_pipe, text_cache):
    """Two prompts of 2 samples each, with their own noise and group ids that are not 0, 1 (a rank's groups of a
    bigger step): every sample takes its own prompt's prefix, as when each sample runs the prefix alone. Seen
    failing when every sample takes the first prompt's prefix (x = x_r[owner] with owner all 0): "Mismatched
    elements: 11520 / 27648"."""
    s = SamplerSettings(sde_type="flow_grpo", eta=0.7, num_steps=5, cfg_scale=4.0)
    prompts = [PROMPT, PROMPT, "a blue cube slides", "a blue cube slides"]

    def run(**kw):
        return rollout(
            tiny_pipe.transformer, text_cache.get(prompts), text_cache.get([""]), prompts=prompts,
            prompt_ids=torch.tensor([3, 3, 1, 1]), generation_ids=torch.tensor([0, 1, 0, 1]),
            prompt_seeds=torch.tensor([5, 5, 9, 9]),
            latent_shape=latent_shape(tiny_pipe.vae.config, TINY_FRAMES, TINY_H, TINY_W), settings=s,
            image_tokens=tiny_pipe.vision_num_semantic_tokens, base_seed=3, sde_steps=window_mask(5, 3, 5),
            same_noise=True, **kw)

    separate, shared = run(), run(share_prefix=True)
    assert not torch.allclose(separate.latents[0, 3], separate.latents[2, 3])  # the two prompts' prefixes differ
    torch.testing.assert_close(shared.latents, separate.latents, rtol=0, atol=1e-5)
    torch.testing.assert_close(shared.log_probs, separate.log_probs, rtol=0, atol=1e-5, equal_nan=True)


@pytest.mark.slow
def test_training_with_a_sliding_window_and_a_shared_prefix(tiny_model, tmp_path, monkeypatch):
    """T = 4, window of 2 sliding by 1 every update from step 1: windows [1, 3), [2, 4), [1, 3), [2, 4); the prefix
    is shared. The first update's ratio is exactly 1 and every trained step lies in its round's window. (Resumed
    bitwise, on 2 FSDP2 ranks against one process: tests/test_post_train.py's fsdp_dp2_window layout.)"""
    from post_train_helpers import _args, pt

    from sage_grpo.metrics import read_metrics

    plans = []
    plan_round = pt.plan_round

    def recording(c, state, traj):
        plan = plan_round(c, state, traj)
        plans.append((traj.sde_steps.clone(), plan.clone()))
        return plan

    monkeypatch.setattr(pt, "plan_round", recording)
    extra = ["--sde_window_start", "1", "--sde_window_size", "2", "--sde_window_stride", "1", "--sde_window_every",
             "1", "--use_same_noise", "True", "--shared_prefix", "True", "--update_ref_model_step", "1",
             "--kl_warmup_updates", "1", "--kl_weight", "1e-2", "--kl_coef", "1e-3", "--learning_rate", "1e-3"]
    pt.main(_args(tiny_model, tmp_path, "--max_steps", "4", *extra))
    assert [w.nonzero().flatten().tolist() for w, _ in plans] == [[1, 2], [2, 3], [1, 2], [2, 3]]
    assert all(bool(w[p].all()) for w, p in plans) and all(p.shape[1] == 2 for _, p in plans)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[0]["train/ratio_min"] == rows[0]["train/ratio_max"] == 1.0
    assert [r["rollout/window_start"] for r in rows] == [1, 2, 1, 2]


# the other recipes' first ratio: paper (tests/test_post_train.py), sliding_shared (above), cfg_free and
# cfg_free_sliding (tests/test_bench_step.py); window is the sliding window's fixed case
@pytest.mark.parametrize("recipe", ["sliding"])
def test_every_recipe_trains_with_ratio_one_at_the_first_update(tiny_model, tmp_path, recipe):
    from post_train_helpers import _args, pt

    from sage_grpo.metrics import read_metrics
    from sage_grpo.recipes import recipe_flags

    pt.main(_args(tiny_model, tmp_path, "--max_steps", "1", *recipe_flags(recipe, 4)))
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row["train/ratio_min"] == row["train/ratio_max"] == 1.0 and row["reward/failed"] == 0
