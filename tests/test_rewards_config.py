"""The training loop builds its reward from the resolved config: check that every reward flag reaches it."""

from types import SimpleNamespace

import torch
from helpers import TINY_MIN_PIXELS, smooth_videos

from sage_grpo.config import load_config
from sage_grpo.rewards import CompositeReward, build_reward, build_reward_from_config


def test_videoalign_flags_reach_the_reward(tiny_dirs):  # noqa: F811
    argv = ["--pretrained_model_root", str(tiny_dirs["root"]), "--reward_weights", '{"vq":1,"mq":0,"ta":2}',
            "--reward_dtype", "fp32", "--reward_min_pixels", str(TINY_MIN_PIXELS), "--reward_max_pixels", "6272",
            "--reward_checkpoint_step", "2", "--reward_sample_fps", "8"]
    cfg = load_config(argv)
    reward = build_reward_from_config(cfg)
    direct = build_reward(reward_model="videoalign_local", reward_weights={"VQ": 1, "MQ": 0, "TA": 2},
                          pretrained_model_root=tiny_dirs["root"], dtype="fp32", min_pixels=TINY_MIN_PIXELS,
                          max_pixels=6272, reward_checkpoint_step=2, sample_fps=8)
    videos, prompts = smooth_videos(b=2), ["a cat", "a dog"]
    a, b = reward(videos, prompts), direct(videos, prompts)
    torch.testing.assert_close(a["total"], b["total"])
    torch.testing.assert_close(a["total"], a["VQ"] + 2 * a["TA"])
    newest = build_reward_from_config(load_config(argv[:-4] + ["--reward_sample_fps", "8"]))
    assert not torch.allclose(newest(videos, prompts)["VQ"], a["VQ"])  # step 2 is not the newest (8)


def test_tiny_demo_config_builds_a_weight_free_reward():
    cfg = load_config(["--config", "configs/tiny_cpu.yaml"])
    reward = build_reward_from_config(cfg)
    dark, bright = torch.full((1, 3, 3, 8, 8), 0.2), torch.full((1, 3, 3, 8, 8), 0.8)
    out = reward(torch.cat([dark, bright]), ["a", "b"])
    assert out["total"][1] > out["total"][0]


class _Pair:
    """Two components, A and B; the scores come from the test, not from the videos."""

    components = ("A", "B")
    default_weights = {"A": 1.0, "B": 1.0}

    def __call__(self, videos, prompts):
        raise AssertionError("not called: reward_phase gets its scores from score_videos")


def _reward_phase(monkeypatch, flags, a, b):
    """post_train.reward_phase on 2 groups of 4 with the component scores a, b [8] (weights A 1, B 2), one process:
    -> (advantages [8], valid [8], metrics, the composite)."""
    from post_train_helpers import pt

    cfg = load_config(["--num_generations", "4", "--reward_weights", '{"A":1,"B":2}', *flags])
    reward = CompositeReward({"pair": _Pair()}, {"A": 1.0, "B": 2.0},
                             [o for o in cfg.reward.reward_optional.split(",") if o])
    a, b = torch.tensor(a), torch.tensor(b)
    total = 1.0 * a + 2.0 * b  # [8] as CompositeReward adds them, NaN where either failed
    names = ["A", "B", "total"]
    monkeypatch.setattr(pt, "score_videos", lambda c, traj, early=None: (names, torch.stack([a, b, total], dim=1)))
    c = SimpleNamespace(cfg=cfg, reward=reward,
                        info=SimpleNamespace(device=torch.device("cpu"), dp_group=None, dp_rank=0))
    traj = SimpleNamespace(prompt_ids=torch.arange(2).repeat_interleave(4), batch_size=8)
    adv, valid, metrics = pt.reward_phase(c, traj)
    return adv, valid, metrics, total


A8 = [0.1, 0.5, 0.2, 0.9, 0.3, 0.3, 0.8, 0.4]
B8 = [10.0, 40.0, 20.0, 30.0, 5.0, 50.0, 15.0, 45.0]  # ~50x A's scale


def test_reward_combine_default_is_the_weighted_sum_bitwise(monkeypatch):
    """The default (weighted_sum, nothing optional) trains on the composite's total, bitwise as before."""
    from sage_grpo.advantage import group_advantages

    adv, valid, metrics, total = _reward_phase(monkeypatch, [], A8, B8)
    expected, ok = group_advantages(total, torch.arange(2).repeat_interleave(4))
    assert torch.equal(adv, expected) and torch.equal(valid, ok)


def test_reward_combine_component_norm_reaches_the_advantages(monkeypatch):
    """--reward_combine component_norm: z-score A and B within each group (numpy, population std), 1 z_A + 2 z_B,
    then the group advantage of that."""
    import numpy as np

    adv, valid, _, _ = _reward_phase(monkeypatch, ["--reward_combine", "component_norm"], A8, B8)
    a, b = np.array(A8, dtype=np.float64).reshape(2, 4), np.array(B8, dtype=np.float64).reshape(2, 4)

    def z(x):
        return (x - x.mean(axis=1, keepdims=True)) / (x.std(axis=1, keepdims=True) + 1e-8)

    s = z(a) + 2 * z(b)
    expected = (s - s.mean(axis=1, keepdims=True)) / (s.std(axis=1, keepdims=True) + 1e-8)
    np.testing.assert_allclose(adv.numpy(), np.clip(expected, -5, 5).ravel(), rtol=1e-5, atol=1e-6)
    assert valid.all()


def test_reward_optional_keeps_a_video_whose_optional_score_failed(monkeypatch):
    """Video 1's B failed: required (the default) it is masked; with --reward_optional b (case-insensitive) it
    trains, its B counted as the mean of its group's other B scores (10, 20, 30 -> 20)."""
    from sage_grpo.advantage import group_advantages

    b = list(B8)
    b[1] = float("nan")
    _, valid, metrics, _ = _reward_phase(monkeypatch, [], A8, b)
    assert not valid[1] and valid.sum() == 7 and metrics["reward/failed"] == 1
    adv, valid, metrics, _ = _reward_phase(monkeypatch, ["--reward_optional", "b"], A8, b)
    assert valid.all() and metrics["reward/failed"] == 0
    s = torch.tensor(A8, dtype=torch.float64) + 2 * torch.tensor(b[:1] + [20.0] + b[2:], dtype=torch.float64)
    expected, _ = group_advantages(s, torch.arange(2).repeat_interleave(4))
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-6)


def test_reward_optional_flag_reaches_the_composite():
    reward = build_reward_from_config(load_config(["--config", "configs/tiny_cpu.yaml", "--reward_model",
                                                   "brightness,color", "--reward_weights", "",
                                                   "--reward_optional", "COLOR"]))
    assert reward.optional == frozenset({"color"})
