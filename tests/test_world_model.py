"""The committed pretrained tiny world model (assets/tiny_world/hunyuanvideo15 and its image-to-video checkpoint
hunyuanvideo15_i2v): it loads through the real loader and its fixed-seed ODE samples of held-out captions meet the
quality it was committed with (scripts/eval_tiny.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sage_grpo.world.pretrain import WORLD_I2V_MODEL_DIR, WORLD_MODEL_DIR, PretrainSettings

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / WORLD_MODEL_DIR
I2V_MODEL = ROOT / WORLD_I2V_MODEL_DIR

# Floors under what 12 held-out captions (seed 0, 20 ODE steps, CFG 4) reach with the committed weights: measured
# colour 0.42, shape 0.17, motion 0.08, background 1.00. The targets (colour 0.8, shape 0.5, direction 0.6)
# are NOT reached at this CPU budget (README "The tiny world model" says why); these floors guard what is reached
# (chance: colour 1/6, shape 1/3 of the videos that show an object at all).
FLOOR = {"color": 0.3, "shape": 0.08, "background": 0.9}


# The settings of the text-to-video checkpoint (the previous defaults) and the I2V checkpoint's floors, under what
# 12 held-out captions (seed 0, 20 ODE steps, CFG 4, each caption's rendered first frame given) reach: measured
# colour 1.00, shape 0.17, motion 0.92, background 1.00, first-frame error 0.042.
PREVIOUS = PretrainSettings(transformer_steps=1300, object_weight=0.0, i2v_prob=0.0)
I2V_FLOOR = {"color": 0.9, "motion": 0.8, "background": 0.9}
I2V_FIRST_FRAME_ERROR = 0.06


@pytest.fixture(scope="module")
def world_pipe():
    from sage_grpo.models.loading import load_pipeline

    return load_pipeline(model_path=str(MODEL), dtype="fp32")


def test_committed_model_is_small_and_records_how_it_was_made():
    """The image-to-video checkpoint is scripts/pretrain_tiny.py's output for its defaults; the text-to-video one is
    still the previous model (1,300 steps, plain MSE, no I2V batches: the demo's training is calibrated on it,
    docs/world_model.md says why), whose VAE stage had the same settings: the two share the VAE file."""
    for model, settings in ((I2V_MODEL, PretrainSettings()), (MODEL, PREVIOUS)):
        size = sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
        assert size < 25 * 2**20
        info = json.loads((model / "pretrain_info.json").read_text())
        # the previous model predates object_weight and i2v_prob (its values: plain MSE, text-to-video only)
        missing = {"object_weight", "i2v_prob"} if model == MODEL else set()
        assert info["settings"] == {k: v for k, v in settings.to_dict().items() if k not in missing}
    name = "vae/diffusion_pytorch_model.safetensors"  # git stores the identical file once
    assert (MODEL / name).read_bytes() == (I2V_MODEL / name).read_bytes()


def test_committed_model_loads_like_real_weights(world_pipe):
    assert type(world_pipe.transformer).__name__ == "HunyuanVideo15Transformer3DModel"
    assert type(world_pipe.vae).__name__ == "AutoencoderKLHunyuanVideo15"
    assert world_pipe.transformer.dtype == torch.float32  # stored bf16, loaded at the asked dtype


def test_committed_model_draws_heldout_captions(world_pipe):
    from sage_grpo.world.evaluate import eval_captions, quality, sample_world_videos

    torch.set_num_threads(1)
    captions = eval_captions(12)
    videos = sample_world_videos(world_pipe, captions, steps=20, cfg_scale=4.0, seed=0)
    q = quality(videos, captions, seeds=list(range(len(captions))))
    for k, floor in FLOOR.items():
        assert q[k] >= floor, (k, q)


def test_committed_i2v_model_animates_a_given_first_frame(tmp_path):
    """The image-to-video checkpoint, each held-out caption's rendered first frame given: the video starts from it
    and moves as the caption says (floors under the measured values, I2V_FLOOR)."""
    from sage_grpo.models.loading import load_pipeline
    from sage_grpo.world.evaluate import (
        eval_captions,
        first_frame_error,
        quality,
        sample_world_videos,
        write_first_frames,
    )

    torch.set_num_threads(1)
    pipe = load_pipeline(model_path=str(I2V_MODEL), dtype="fp32")
    assert pipe.sage_grpo_task == "i2v"
    captions = eval_captions(12)
    seeds = list(range(len(captions)))
    paths, frames = write_first_frames(captions, seeds, tmp_path)
    videos = sample_world_videos(pipe, captions, steps=20, cfg_scale=4.0, seed=0, image_paths=paths)
    q = quality(videos, captions, seeds=seeds)
    for k, floor in I2V_FLOOR.items():
        assert q[k] >= floor, (k, q)
    assert float(first_frame_error(videos, frames).mean()) <= I2V_FIRST_FRAME_ERROR


@pytest.mark.slow  # the demo's first 20 GRPO steps on the world model: 94 s on one thread of the 2-core machine
def test_the_demo_training_rises_with_the_hacking_check_silent(tmp_path, monkeypatch):
    """scripts/demo.sh's training (configs/tiny_world.yaml: world_size inside the calibrated trust region) for its
    first 10 steps, validated on the held-out captions at steps 0 and 10: the size reward rises (0.083 -> 0.174 here,
    three times the margin asserted; the demo's 40 steps reach their highest validation at step 10) and the hacking
    check stays silent. One torch thread (the numbers depend on the thread count; with 2 threads beside the other
    test worker the run cost 4x the CPU). The same run with a weaker trust region (--kl_weight 0.01 --kl_coef 0.01
    --kl_min_coef 0.01 --threads 1) warned 3 times at step 20 (contrast, motion, background cleanliness; with 2
    threads: background cleanliness, caption background, motion), and with KL off at step 20
    (docs/world_model.md)."""
    from post_train_helpers import pt

    from sage_grpo.metrics import read_metrics

    monkeypatch.chdir(ROOT)  # the config's paths are relative to the repository
    torch.set_num_threads(1)
    out = tmp_path / "run"
    pt.main(["--config", "configs/tiny_world.yaml", "--output_dir", str(out), "--max_steps", "10",
             "--save_interval", "0"])
    val = {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "val/reward_total" in r}
    assert sorted(val) == [0, 10]
    assert [val[s]["val/hacking_warnings"] for s in (0, 10)] == [0, 0]
    assert val[10]["val/reward_total"] > val[0]["val/reward_total"] + 0.03, (val[0], val[10])
    assert val[10]["val/drift"] > 0.0


def test_the_i2v_motion_config_passes_the_launch_checks(monkeypatch):
    """configs/tiny_world_i2v_motion.yaml (scripts/demo.sh, part 5) passes post_train.py's preflight as the demo runs
    it (its prompt files and reference images read, the committed checkpoint an I2V one, the reward built), with
    the settings docs/world_model.md says made GRPO move on the new model: one initial noise per group, eta 1 on an
    SDE window of the first 5 of 10 steps, 8 prompts a step, learning rate 5e-4, no CFG, the statistics left out of
    the held-out metrics, the hacking check's reward gate at 0.5 spreads."""
    from post_train_helpers import pt

    from sage_grpo.config import load_config
    from sage_grpo.data import read_prompts

    monkeypatch.chdir(ROOT)  # the config's paths are relative to the repository
    cfg = load_config(["--config", "configs/tiny_world_i2v_motion.yaml"])
    pt.preflight(cfg, 1)
    r, v = cfg.rollout, cfg.validation
    assert (r.use_same_noise, r.eta, r.sde_window_start, r.sde_window_size, r.grpo_sampling_steps) == (True, 1.0, 0, 5,
                                                                                                      10)
    assert (cfg.data.batch_size, cfg.optim.learning_rate, r.cfg_scale, v.validation_guidance_scale) == (8, 5e-4, 1, 1)
    assert cfg.model.model_path == WORLD_I2V_MODEL_DIR and "statistics" not in v.validation_metrics
    assert (v.hacking_reward_rise, v.hacking_metric_drop) == (0.5, 1.0)  # the gate docs/world_model.md measured
    assert len(read_prompts(cfg.data.train_video_csv)) == 96 and len(read_prompts(v.valid_video_csv)) == 16
