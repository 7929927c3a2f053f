"""The training loop builds its reward from the resolved config: check that every reward flag reaches it."""

import torch
from helpers import TINY_MIN_PIXELS, smooth_videos

from sage_grpo.config import load_config
from sage_grpo.rewards import build_reward, build_reward_from_config


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
