"""scripts/demo_compare.py's statistics against numpy (the rollout windows and the paired before/after change), its
verdict against the documented range and its reading of the run's hacking check."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import demo_compare  # noqa: E402

from sage_grpo.errors import SageGRPOError  # noqa: E402


def test_paired_stats_equal_a_paired_t_statistic():
    rng = np.random.default_rng(0)
    before = rng.normal(0.3, 0.1, 12)
    after = before + rng.normal(0.05, 0.02, 12)
    got = demo_compare.paired_stats(before.tolist(), after.tolist())
    d = after - before
    assert got["paired_change"] == pytest.approx(d.mean())
    assert got["paired_std_errors"] == pytest.approx(d.mean() / (d.std(ddof=1) / math.sqrt(len(d))))
    # the pairing matters: the unpaired spread of `before` (0.1) would give a far smaller statistic
    assert got["paired_std_errors"] > 3 * d.mean() / math.sqrt(before.var(ddof=1) / 12 + after.var(ddof=1) / 12)
    assert demo_compare.paired_stats([0.0, 1.0], [0.5, 1.5])["paired_std_errors"] == math.inf
    assert math.isnan(demo_compare.paired_stats([0.1, 0.2], [0.1, 0.2])["paired_std_errors"])
    assert math.isnan(demo_compare.paired_stats([0.1], [0.3])["paired_std_errors"])


def test_learning_stats_compare_the_first_and_last_windows(tmp_path):
    rng = np.random.default_rng(1)
    r = np.concatenate([rng.normal(0.2, 0.05, 15), rng.normal(0.3, 0.05, 15)])
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": i + 1, "reward/total_mean": float(v)} for i, v in enumerate(r)] + [{"step": 30, "val/x": 1.0}]
    path.write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    got = demo_compare.learning_stats(path, window=10)
    first, last = r[:10], r[-10:]
    se = math.sqrt(first.var(ddof=1) / 10 + last.var(ddof=1) / 10)
    assert got["steps"] == 30
    assert got["std_errors"] == pytest.approx((last.mean() - first.mean()) / se)
    with pytest.raises(SageGRPOError, match="at least 40"):
        demo_compare.learning_stats(path, window=20)


def test_the_documented_ranges_are_measured_ones():
    for kind, e in demo_compare.EXPECTED.items():
        lo, hi = e["range"]
        assert 0 < lo < hi, kind  # a demo run that does not raise its reward is never expected
        assert e["measured"] and e["hacking"], kind


@pytest.mark.parametrize("value, word", [(3.0, "expected: "), (2.0, "expected: "), (5.0, "expected: "),
                                         (1.99, "UNEXPECTED: "), (5.01, "UNEXPECTED: "), (-3.0, "UNEXPECTED: "),
                                         (math.nan, "UNEXPECTED: "), (math.inf, "UNEXPECTED: ")])
def test_the_verdict_says_whether_a_run_is_inside_the_documented_range(monkeypatch, value, word):
    monkeypatch.setitem(demo_compare.EXPECTED, "t2v", {**demo_compare.EXPECTED["t2v"], "range": (2.0, 5.0)})
    line = demo_compare.verdict("t2v", value)
    assert line.startswith(word), line
    assert "[2.0, 5.0]" in line and "world_size" in line
    assert ("docs/world_model.md#" in line) == (word == "UNEXPECTED: ")


def _run_with_validations(tmp_path, warned: dict) -> Path:
    run = tmp_path / "run"
    ckpt = run / "checkpoint-40"
    ckpt.mkdir(parents=True)
    (ckpt / "train_state.json").write_text(json.dumps({"step": 40, "hacking_warned": warned}))
    rows = []
    for step in range(41):
        rows.append({"step": step, "reward/total_mean": 0.1})
        if step % 10 == 0:
            shift = -0.3 * step / 10  # the background falls 0.3 spreads a validation: -0.9 at step 30
            rows[-1].update({"val_shift/reward_total": 0.25 * step / 10, "val_shift/world_object_persistence": 0.1,
                             "val_shift/world_background_cleanliness": shift,
                             "val/hacking_warnings": int(bool(warned) and step >= 30)})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_the_hacking_summary_reads_a_silent_run(tmp_path):
    run = _run_with_validations(tmp_path, {})
    got = demo_compare.hacking_summary(run, run / "checkpoint-40")
    assert got["hacking_warned"] == {}
    assert got["hacking_check"] == ("silent over the validations at steps 0, 10, 20, 30, 40 (held-out reward +1.00 "
                                    "spreads at step 40; largest fall world_background_cleanliness -1.20)")


def test_the_hacking_summary_names_the_step_and_metric_of_a_warning(tmp_path):
    run = _run_with_validations(tmp_path, {"world_background_cleanliness": 30})
    got = demo_compare.hacking_summary(run, run / "checkpoint-40")
    assert got["hacking_warned"] == {"world_background_cleanliness": 30}
    assert got["hacking_shift"]["world_background_cleanliness"] == pytest.approx(-0.9)
    assert got["hacking_check"].startswith("fired at step 30 on world_background_cleanliness (-0.90 spreads) (")


def test_expect_takes_only_the_demo_parts(tmp_path, capsys):
    with pytest.raises(SystemExit):
        demo_compare.main(["--run", str(tmp_path), "--out", str(tmp_path / "o"), "--expect", "x"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--prompts", "0"], ["--strip_prompts", "0"]])
def test_zero_prompts_is_one_error_before_anything_loads(tmp_path, flags):
    with pytest.raises(SageGRPOError, match="must be >= 1"):
        demo_compare.main(["--run", str(tmp_path), "--out", str(tmp_path / "o"), *flags])


@pytest.mark.slow
def test_an_i2v_run_is_compared_on_its_reference_images(tiny_i2v_dir, tmp_path):
    """An image-to-video run: the before and after samples are conditioned on each prompt's reference image (before,
    the base model's sample equals one made here with the image: its reward and first-frame fidelity), and the
    summary reports the first-frame fidelity of both. The run is one saved step; its metrics are repeated to the 20
    rows the learning statistics need (they are tested above)."""
    import torch
    from helpers import i2v_prompts
    from post_train_helpers import _args, pt

    from sage_grpo.config import load_config, torch_dtype
    from sage_grpo.data import read_prompts
    from sage_grpo.generation import sample_videos
    from sage_grpo.heldout import first_frame_fidelity
    from sage_grpo.models.image_cond import ImageConditioningCache, reference_pixels
    from sage_grpo.models.loading import load_pipeline
    from sage_grpo.models.text_cache import TextEmbeddingCache
    from sage_grpo.rewards import build_reward_from_config
    from sage_grpo.rollout import SamplerSettings, latent_shape

    csv = i2v_prompts(tmp_path / "data", n=2)
    run = tmp_path / "run"
    pt.main(_args(tiny_i2v_dir, run, "--train_video_csv", str(csv), "--num_generations", "2", "--max_steps", "1",
                  "--save_interval", "1", "--validation_num_inference_steps", "2", "--validate_video_length", "5"))
    row = (run / "metrics.jsonl").read_text().splitlines()[0]
    (run / "metrics.jsonl").write_text((row + "\n") * 20)
    got = demo_compare.main(["--run", str(run), "--out", str(tmp_path / "cmp"), "--prompts", "2",
                             "--strip_prompts", "1"])

    cfg = load_config(["--config", str(run / "config.yaml")])
    v = cfg.validation
    pipe = load_pipeline(model_path=str(tiny_i2v_dir), dtype="fp32")
    dtype = torch_dtype(cfg.model.dtype)
    records = read_prompts(csv)
    settings = SamplerSettings(sde_type="ode", eta=0.0, num_steps=v.validation_num_inference_steps,
                               shift=v.validation_timestep_shift, cfg_scale=v.validation_guidance_scale,
                               compute_dtype=dtype)
    h, w = (int(x) for x in v.validation_fixed_size.split("x"))
    videos = [video for _, video in sample_videos(
        pipe, TextEmbeddingCache(pipe, "cpu", dtype), records, settings=settings,
        shape=latent_shape(pipe.vae.config, v.validate_video_length, h, w), base_seed=v.validation_seed,
        negative_prompt=cfg.rollout.neg_prompt, images=ImageConditioningCache(pipe, "cpu", dtype))]
    reward = build_reward_from_config(cfg)
    before = [float(reward(x[None], [r.prompt])["total"][0]) for x, r in zip(videos, records)]
    fidelity = [first_frame_fidelity(x, reference_pixels(r.ref_image_path, x.shape[-2], x.shape[-1]))
                for x, r in zip(videos, records)]
    assert got["reward_before"] == pytest.approx(sum(before) / 2, abs=1e-6)
    assert got["first_frame_fidelity_before"] == pytest.approx(sum(fidelity) / 2, abs=1e-4)
    assert 0 < got["first_frame_fidelity_after"] < 1
    assert len(list((tmp_path / "cmp" / "after").glob("*.mp4"))) == 2 and torch.isfinite(torch.tensor(before)).all()
