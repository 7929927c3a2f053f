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

# Floors under what 12 held-out captions (seed 0, 20 ODE steps, CFG 4) reach with the committed text-to-video
# checkpoint: measured colour 1.00, shape 0.33, motion 0.92, background 1.00 (chance: colour 1/7, shape 1/3, motion
# 1/5). The shape target (0.5) is not reached (docs/world_model.md, "What was tried").
FLOOR = {"color": 0.9, "shape": 0.25, "motion": 0.75, "background": 0.9}

# The I2V checkpoint's floors, under what the same 12 captions reach with each caption's rendered first frame given
# (`python scripts/eval_tiny.py --i2v --num_captions 12 --seed S`): at seed 0 colour 1.00, shape 0.17, motion 0.75,
# background 1.00, first-frame error 0.041. Motion depends on the noise: over seeds 0-9, with the noise seeded by the
# reference image too and without, it reads 0.67-0.92 (14 of the 20 draws 0.75), mean 0.77, standard deviation
# 0.05, so its floor is the mean minus two standard deviations (8 of the 12 videos). The same captions from centred
# first frames without CFG read 0.42; the T2V checkpoint, which ignores the image, reads first-frame error 0.10.
I2V_FLOOR = {"color": 0.9, "motion": 0.66, "background": 0.9}
I2V_FIRST_FRAME_ERROR = 0.06


@pytest.fixture(scope="module")
def world_pipe():
    from sage_grpo.models.loading import load_pipeline

    return load_pipeline(model_path=str(MODEL), dtype="fp32")


def test_committed_model_is_small_and_records_how_it_was_made():
    """Both checkpoints are scripts/pretrain_tiny.py's output for its defaults, from one run: the text-to-video one
    is the image-to-video one without the SigLIP image encoder, so they share the transformer and VAE files (git
    stores each once)."""
    for model in (MODEL, I2V_MODEL):
        size = sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
        assert size < 25 * 2**20
        info = json.loads((model / "pretrain_info.json").read_text())
        assert info["settings"] == PretrainSettings().to_dict()
    for name in ("vae/diffusion_pytorch_model.safetensors", "transformer/diffusion_pytorch_model.safetensors"):
        assert (MODEL / name).read_bytes() == (I2V_MODEL / name).read_bytes()
    assert not (MODEL / "image_encoder").exists() and (I2V_MODEL / "image_encoder").is_dir()


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


@pytest.mark.slow
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


@pytest.mark.slow  # the I2V demo's first 6 GRPO steps on the world model: about 35 s on one thread
def test_the_i2v_demo_training_teaches_motion_with_the_hacking_check_silent(tmp_path, monkeypatch):
    """scripts/demo.sh's image-to-video training (configs/tiny_world_i2v_motion.yaml: world_motion from centred first
    frames, no CFG) for its first 6 steps, validated on the 16 held-out prompts at steps 0 and 6: the motion reward
    rises (0.115 -> 0.124 here, twice the margin asserted; validated every 2 steps it reads 0.115, 0.115, 0.123,
    0.124, 0.126, 0.129 at steps 0-10) and the hacking check, armed at the config's 0.5-spread gate, stays silent.
    The 6 steps' rise is small beside its noise: over 8 pairs of --seed and --validation_seed (42/930, then 1/931 to
    7/937), with the rollout and validation noise seeded by the reference image and the group's position and
    without, it reads +0.0075 on average, standard deviation 0.006, -0.0002 to +0.020 (12 of the 16 clear the
    margin); with --learning_rate 0 it is exactly 0. Through post_train.py's main, so the preflight reads the prompt
    folders and reference images and checks the checkpoint is an I2V one. One torch thread (the numbers depend on the
    thread count after some steps)."""
    from post_train_helpers import pt

    from sage_grpo.metrics import read_metrics

    monkeypatch.chdir(ROOT)  # the config's paths are relative to the repository
    torch.set_num_threads(1)
    out = tmp_path / "run"
    pt.main(["--config", "configs/tiny_world_i2v_motion.yaml", "--output_dir", str(out), "--max_steps", "6",
             "--validation_interval", "6", "--save_interval", "0"])
    val = {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "val/reward_total" in r}
    assert sorted(val) == [0, 6]
    assert [val[s]["val/hacking_warnings"] for s in (0, 6)] == [0, 0]
    assert val[6]["val/reward_total"] > val[0]["val/reward_total"] + 0.004, (val[0], val[6])
    assert val[6]["val/drift"] > 0.0 and "val/first_frame_fidelity" in val[6]


@pytest.mark.parametrize(("config", "model", "prompts", "cfg_scale"),
                         [("configs/tiny_world.yaml", WORLD_MODEL_DIR, (64, 8), 4.0),
                          ("configs/tiny_world_i2v_motion.yaml", WORLD_I2V_MODEL_DIR, (96, 16), 1.0)])
def test_the_demo_configs_pass_the_launch_checks_with_the_recipe_that_moves_the_model(config, model, prompts,
                                                                                      cfg_scale, monkeypatch):
    """The demo's two training configs (scripts/demo.sh parts 4 and 5) pass post_train.py's preflight as the demo runs
    them (prompt files and, for I2V, reference images read; the checkpoint of the right task; the reward built), with
    the settings docs/world_model.md says made GRPO move on the new model: one initial noise per group, eta 1 on an
    SDE window of the first 5 of 10 steps, 2 prompts x G 4 a step, learning rate 5e-4. The I2V task runs without CFG,
    leaves the video statistics out of the held-out metrics and arms the hacking check at 0.5 spreads."""
    from post_train_helpers import pt

    from sage_grpo.config import load_config
    from sage_grpo.data import read_prompts

    monkeypatch.chdir(ROOT)  # the config's paths are relative to the repository
    cfg = load_config(["--config", config])
    pt.preflight(cfg, 1)
    r, v = cfg.rollout, cfg.validation
    assert (r.use_same_noise, r.eta, r.sde_window_start, r.sde_window_size, r.grpo_sampling_steps) == (True, 1.0, 0, 5,
                                                                                                      10)
    assert (cfg.data.batch_size, cfg.data.num_generations, cfg.optim.learning_rate) == (8, 4, 5e-4)
    assert (r.cfg_scale, v.validation_guidance_scale) == (cfg_scale, cfg_scale)
    assert cfg.model.model_path == model
    assert (len(read_prompts(cfg.data.train_video_csv)), len(read_prompts(v.valid_video_csv))) == prompts
    if model == WORLD_I2V_MODEL_DIR:
        assert "statistics" not in v.validation_metrics
        assert (v.hacking_reward_rise, v.hacking_metric_drop) == (0.5, 1.0)  # the gate docs/world_model.md measured


@pytest.mark.parametrize("config", ["configs/tiny_world.yaml", "configs/tiny_world_i2v.yaml",
                                    "configs/tiny_world_i2v_motion.yaml"])
def test_the_shipped_world_configs_and_their_checkpoint_agree_on_sampling(config, monkeypatch, capsys):
    """The configs shipped for the committed world model (scripts/demo.sh's generate and training parts, the docs'
    I2V run) sample at their checkpoint's own flow shift and CFG scale, or with CFG off (scale 1, a recipe: the I2V
    demo's task is motion without guidance), so neither post_train.py's setup nor generate.py --config prints a
    warning the project caused. The checkpoints' guider holds WORLD_GUIDANCE_SCALE, the scale the configs and
    scripts/eval_tiny.py sample with. Seen failing with the committed guider at diffusers' 6: "warning:
    --validation_guidance_scale 4 differs from the checkpoint's own default 6" (and the same for --cfg_scale), and
    with CFG off warned about as a scale that differs."""
    from types import SimpleNamespace

    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler
    from post_train_helpers import pt

    import generate
    from sage_grpo.config import load_config
    from sage_grpo.models.loading import locate_model
    from sage_grpo.parallel.dist import init_distributed
    from sage_grpo.world.pretrain import WORLD_GUIDANCE_SCALE

    monkeypatch.chdir(ROOT)  # the config's paths are relative to the repository
    cfg = load_config(["--config", config])
    pt.preflight(cfg, 1)  # resolves the flags no config key sets from the checkpoint, before any model loads
    model = ROOT / cfg.model.model_path
    guider = ClassifierFreeGuidance.from_pretrained(model / "guider")
    assert guider.guidance_scale == WORLD_GUIDANCE_SCALE
    # the parts of the pipeline warn_checkpoint_defaults reads (their config files only: no weights load)
    pipe = SimpleNamespace(scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(model / "scheduler"),
                           guider=guider, transformer=SimpleNamespace(config=SimpleNamespace(
                               use_meanflow=json.loads((model / "transformer" / "config.json").read_text())
                               .get("use_meanflow", False))))
    capsys.readouterr()
    pt.warn_checkpoint_defaults(cfg, init_distributed(), pipe)
    args = generate.resolve_args(generate.build_parser().parse_args(["--config", config, "--prompt", "a red circle"]))
    loc = locate_model(args.pretrained_model_root, args.model_path, args.pretrained_transformer_version)
    generate._checkpoint_defaults(args, SimpleNamespace(sage_grpo_location=loc), 0)
    shown = capsys.readouterr().out
    assert "warning" not in shown, shown
    assert (args.cfg_scale, args.flow_shift) == (cfg.validation.validation_guidance_scale,
                                                 cfg.validation.validation_timestep_shift)
