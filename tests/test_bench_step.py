"""scripts/bench_step.py counts the real loop's work (post_train.setup + train, instrumented from outside): the
counts are deterministic and must equal the configuration's minimum. Timings are not asserted (see the script)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_script

from sage_grpo.recipes import minimum_forwards

ROOT = Path(__file__).resolve().parents[1]


bs = load_script("scripts/bench_step.py", register=True)


@pytest.fixture(autouse=True)
def one_thread():
    """Counting needs no speed: one intra-op thread avoids oversubscribing a shared CPU (5x faster here)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _measure(tiny_model, tmp_path, steps, *extra):
    argv = bs.config_argv("tiny", tiny_model, tmp_path / "run", steps,
                          ["--grpo_sampling_steps", "4", "--sample_n_frames", "5", *extra])
    return bs.measure(argv, steps)


def _check_at_minimum(res, text=True):
    for s in res["per_step"]:
        assert s["counts"] == s["minimum"], s["step"]
        assert s["other_forwards"] == {}  # no transformer call outside rollout / anchor / update
        assert s["at_minimum"]
    if text:
        te = res["text_encoder"]
        assert te["text_encoder_samples"] == te["minimum"] == te["distinct_prompts"]  # once per distinct prompt
        assert res["at_minimum"]


def test_counts_at_minimum_dual_kl_moving_anchor(tiny_model, tmp_path):
    """B 4, T 4, CFG, dual KL, anchor refreshed every 2 updates: step 1 initial anchor (0 anchor forwards), step 2
    anchor one update behind, step 3 right after the refresh (0), all at the minimum."""
    res = _measure(tiny_model, tmp_path, 3, "--update_ref_model_step", "2")
    _check_at_minimum(res)
    per = 4 * 4 * 2  # B x T x CFG (every sage_grpo step is noisy and timestep_fraction is 1: k = T)
    assert [s["counts"]["rollout"] for s in res["per_step"]] == [per] * 3
    assert [s["counts"]["update"] for s in res["per_step"]] == [per] * 3
    assert [s["counts"]["anchor"] for s in res["per_step"]] == [0, per, 0]
    assert [s["anchor_synced"] for s in res["per_step"]] == [1, 0, 1]
    assert [s["counts"]["vae_samples"] for s in res["per_step"]] == [4] * 3
    assert [s["counts"]["reward_calls"] for s in res["per_step"]] == [1] * 3
    assert res["text_encoder"]["distinct_prompts"] == 9  # 8 training prompts + the empty negative prompt
    # model FLOPs: step 2's anchor forwards are the update's trained pairs without gradient, so the update (full
    # fine-tuning: forward + a backward of 2 forwards) counts exactly 3x the anchor's
    s1, s2, _ = res["per_step"]
    assert s1["tflop"]["anchor"] == 0 < s1["tflop"]["rollout"]
    assert s2["tflop"]["update"] == pytest.approx(3 * s2["tflop"]["anchor"], rel=1e-9)
    assert s2["tflops"]["update"] == pytest.approx(s2["tflop"]["update"] / s2["phase_s"]["update"])
    assert s2["mfu"]["step"] is None  # the CPU: no peak, no MFU
    s = res["per_step"][-1]
    assert s["inside_total_s"] > 0 and s["step_s"] >= s["inside_total_s"] * 0.999


def test_counts_at_minimum_kl_off(tiny_model, tmp_path):
    res = _measure(tiny_model, tmp_path, 2, "--kl_weight", "0")
    _check_at_minimum(res)
    assert [s["counts"]["anchor"] for s in res["per_step"]] == [0, 0]


def test_counts_at_minimum_training_phase_anchor_and_fraction(tiny_model, tmp_path):
    """Anchor means inside the update (kl_compute_mode training_phase) and half the steps trained; no CFG."""
    res = _measure(tiny_model, tmp_path, 2, "--kl_compute_mode", "training_phase", "--timestep_fraction", "0.5",
                   "--cfg_scale", "1")
    _check_at_minimum(res, text=False)  # the text encoder without CFG: the test below
    assert [s["counts"]["update"] for s in res["per_step"]] == [4 * 2] * 2
    assert [s["counts"]["anchor"] for s in res["per_step"]] == [0, 4 * 2]
    assert [s["counts"]["rollout"] for s in res["per_step"]] == [4 * 4] * 2
    # by phase: those anchor forwards run inside the update phase (gpu_check judges the anchor phase "not run")
    assert [s["phase_forwards"] for s in res["per_step"]] == [{"rollout": 16, "anchor": 0, "update": 8},
                                                              {"rollout": 16, "anchor": 0, "update": 16}]
    assert res["per_step"][0]["ratio_min"] == res["per_step"][0]["ratio_max"] == 1.0  # no CFG: the first update


def test_counts_at_minimum_sliding_window_shared_prefix_no_cfg(tiny_model, tmp_path):
    """The cheap recipe: SDE window of 2 sliding from step 1, shared ODE prefix, no CFG. B 4 = one group of 4: the
    prefix runs once, the window trains 2 steps per sample."""
    res = _measure(tiny_model, tmp_path, 2, "--sde_window_start", "1", "--sde_window_size", "2",
                   "--sde_window_stride", "1", "--sde_window_every", "1", "--use_same_noise", "True",
                   "--shared_prefix", "True", "--cfg_scale", "1", "--kl_weight", "0")
    _check_at_minimum(res, text=False)
    # window [1, 3): prefix 1 step x 1 prompt + 3 steps x 4 samples; window [2, 4): 2 x 1 + 2 x 4
    assert [s["counts"]["rollout"] for s in res["per_step"]] == [1 + 3 * 4, 2 + 2 * 4]
    assert [s["counts"]["update"] for s in res["per_step"]] == [4 * 2] * 2
    assert res["per_step"][0]["ratio_min"] == res["per_step"][0]["ratio_max"] == 1.0  # the first update


def test_text_encoder_no_cfg_does_not_encode_the_negative_prompt(tiny_model, tmp_path):
    res = _measure(tiny_model, tmp_path, 1, "--cfg_scale", "1")
    te = res["text_encoder"]
    assert te["minimum"] == 8  # the 8 training prompts; "" is never used
    assert te["text_encoder_samples"] == te["minimum"] and te["at_minimum"]


def test_minimum_model_accumulation_and_fixed_anchor():
    """The independent minimum: with 2 rounds per update the anchor stays synced through the first update's rounds;
    a fixed anchor is synced only before the first update."""
    from sage_grpo.config import load_config

    cfg = load_config(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--gradient_accumulation_steps", "2",
                       "--update_ref_model_step", "2", "--max_steps", "6"])
    # updates complete after rounds 2, 4, 6; the refresh (every 2 updates) happens at the start of round 5
    assert [m["anchor"] > 0 for m in minimum_forwards(cfg, 6)] == [False, False, True, True, False, False]
    cfg = load_config(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--use_moving_KL", "False"])
    assert [m["anchor"] > 0 for m in minimum_forwards(cfg, 3)] == [False, True, True]


def test_json_report(tmp_path, monkeypatch):
    from sage_grpo.benchjson import write_report

    path = write_report(tmp_path / "r.json", "x", "cpu", {"a/b": 1.5}, {"r": {"v": float("nan")}}, ["n"])
    rep = json.loads(path.read_text())
    assert rep["benchmark"] == "x" and rep["ratios"] == {"a/b": 1.5} and rep["results"] == {"r": {"v": None}}
    assert rep["host"]["measured_on_gpu"] is False and rep["notes"] == ["n"]


def test_counts_at_minimum_with_the_solver_tail_and_one_timestep_per_group(tiny_model, tmp_path):
    """The flash recipe's ingredients: a window [0, 2) of T 4, its tail in 1 UniPC step, one trained step a sample
    drawn per group. The loop runs what minimum_forwards says: 2 window + 1 tail steps a sample."""
    res = _measure(tiny_model, tmp_path, 2, "--sde_window_size", "2", "--ode_solver", "unipc", "--ode_steps", "1",
                   "--timestep_fraction", "0.5", "--group_timesteps", "True", "--cfg_scale", "1", "--kl_weight", "0")
    _check_at_minimum(res, text=False)
    b = res["per_step"][0]["counts"]["update"]  # one trained step a sample: the update's forwards are the batch
    assert [s["counts"]["rollout"] for s in res["per_step"]] == [3 * b] * 2
