"""Every HunyuanVideo-1.5 checkpoint variant (issue 28): tiny checkpoints of each version name with its own
scheduler and guider defaults, the task and the step-distilled r-timestep read from the checkpoint, unknown and
unsupported names refused, and the step-distilled (use_meanflow) rollout equal to diffusers' I2V pipeline."""

from __future__ import annotations

import json

import pytest
import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.models.tiny import VARIANTS

# hv15_variants.md section 2: (task, target size, flow shift, CFG scale, meanflow)
EXPECTED = {
    "480p_t2v": ("t2v", 640, 5.0, 6.0, False),
    "480p_i2v": ("i2v", 640, 5.0, 6.0, False),
    "720p_t2v": ("t2v", 960, 9.0, 6.0, False),
    "720p_i2v": ("i2v", 960, 7.0, 6.0, False),
    "480p_t2v_distilled": ("t2v", 640, 5.0, 1.0, False),
    "480p_i2v_distilled": ("i2v", 640, 5.0, 1.0, False),
    "720p_t2v_distilled": ("t2v", 960, 9.0, 1.0, False),
    "720p_i2v_distilled": ("i2v", 960, 7.0, 1.0, False),
    "480p_i2v_step_distilled": ("i2v", 640, 7.0, 1.0, True),
}


def test_the_variant_table_is_the_checkpoints():
    assert list(VARIANTS) == list(EXPECTED)
    for name, (task, size, shift, cfg, meanflow) in EXPECTED.items():
        v = VARIANTS[name]
        assert (v.task, v.target_size, v.flow_shift, v.guidance_scale, v.use_meanflow) == (task, size, shift, cfg,
                                                                                          meanflow), name
    assert VARIANTS["480p_i2v_step_distilled"].steps in (8, 12)


@pytest.mark.parametrize("layout", ["diffusers", "authors"])
def test_every_version_writes_a_tiny_checkpoint_that_loads_with_its_defaults(tmp_path, layout):
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

    from sage_grpo.models.loading import load_pipeline
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    for name, (task, size, shift, cfg, meanflow) in EXPECTED.items():
        out = write_tiny_checkpoint(tmp_path / name, layout, seed=0, version=name)
        pipe = load_pipeline(model_path=str(out), version=name, dtype="fp32", load_text_encoders=False)
        cls = HunyuanVideo15ImageToVideoPipeline if task == "i2v" else HunyuanVideo15Pipeline
        assert type(pipe) is cls and pipe.sage_grpo_task == task, name
        assert pipe.scheduler.config.shift == shift and pipe.guider.guidance_scale == cfg, name
        t = pipe.transformer.config
        assert t.use_meanflow == meanflow and t.target_size * 640 == size * (64 if task == "t2v" else 32), name


def test_unknown_and_unsupported_versions_are_one_line(tmp_path):
    from sage_grpo.models.loading import locate_model
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    with pytest.raises(SageGRPOError, match=r"unknown HunyuanVideo-1.5 version '480p_iv2'; valid: 480p_t2v, 480p_i2v, "
                                            r"720p_t2v, .*480p_i2v_step_distilled$"):
        locate_model(str(tmp_path), version="480p_iv2")
    with pytest.raises(SageGRPOError, match=r"720p_i2v_distilled_sparse is not supported: sparse attention"):
        locate_model(str(tmp_path), version="720p_i2v_distilled_sparse")
    with pytest.raises(SageGRPOError, match=r"1080p_sr_distilled is not supported: a super-resolution model"):
        write_tiny_checkpoint(tmp_path / "sr", version="1080p_sr_distilled")


def test_step_distilled_rollout_passes_the_next_timestep_as_diffusers_does(tmp_path):
    """The step-distilled 480p I2V model (use_meanflow): our ODE rollout with timestep_r = the next timestep (0 at the
    last step) equals HunyuanVideo15ImageToVideoPipeline with the checkpoint's own shift 7 and guidance 1 (one
    forward); without timestep_r the model gives another video (the r embedding matters)."""
    import numpy as np
    import PIL.Image

    from sage_grpo.models.image_cond import ImageConditioningCache
    from sage_grpo.models.loading import load_pipeline
    from sage_grpo.models.text_cache import TextEmbeddingCache
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint
    from sage_grpo.rollout import INIT_NOISE_STEP, SamplerSettings, derive_seed, latent_shape, predict_velocity, rollout

    out = write_tiny_checkpoint(tmp_path / "sd", seed=0, version="480p_i2v_step_distilled")
    pipe = load_pipeline(model_path=str(out), dtype="fp32")
    assert pipe.transformer.config.use_meanflow and pipe.scheduler.config.shift == 7.0
    assert pipe.guider.guidance_scale == 1.0
    g = np.random.default_rng(0)
    img = PIL.Image.fromarray((g.random((36, 64, 3)) * 255).astype(np.uint8))
    img.save(tmp_path / "a.png")
    text, images = TextEmbeddingCache(pipe, "cpu", torch.float32), ImageConditioningCache(pipe, "cpu", torch.float32)
    image = images.get([str(tmp_path / "a.png")])
    h, w = image.latent_hw
    s, steps, frames = pipe.vae.config.spatial_compression_ratio, 4, 5
    settings = SamplerSettings(sde_type="ode", eta=0.0, num_steps=steps, shift=7.0, cfg_scale=1.0)
    traj = rollout(pipe.transformer, text.get(["a red ball rolls"]), None, prompts=["a red ball rolls"],
                   prompt_ids=torch.zeros(1, dtype=torch.long), generation_ids=torch.zeros(1, dtype=torch.long),
                   prompt_seeds=torch.tensor([7]), latent_shape=latent_shape(pipe.vae.config, frames, h * s, w * s),
                   settings=settings, image_tokens=pipe.vision_num_semantic_tokens, base_seed=3, image=image)
    seed = derive_seed(3, 7, 0, INIT_NOISE_STEP)
    ref = pipe(image=PIL.Image.open(tmp_path / "a.png").convert("RGB"), prompt=["a red ball rolls"], num_frames=frames,
               num_inference_steps=steps, generator=[torch.Generator().manual_seed(seed)], output_type="latent").frames
    assert ref.shape == traj.final_latents.shape and ref.abs().mean() > 0.1
    assert (ref - traj.final_latents).abs().max().item() < 1e-5
    # the r-timestep changes the velocity: the embedding is used, so leaving it out would be silently wrong
    x, sigma = traj.latents[:, 1], traj.sigmas[1:2]
    cond = text.get(["a red ball rolls"])
    v = predict_velocity(pipe.transformer, x, sigma, cond, None, settings, 4, image, traj.sigmas[2:3])
    v_other = predict_velocity(pipe.transformer, x, sigma, cond, None, settings, 4, image, traj.sigmas[3:4])
    assert (v - v_other).abs().max() > 1e-3
    with pytest.raises(ValueError, match="needs sigma_next"):
        predict_velocity(pipe.transformer, x, sigma, cond, None, settings, 4, image)


def test_training_takes_the_checkpoints_defaults_unless_set_and_warns_about_the_step_distilled_model(tmp_path, capsys):
    """post_train on the step-distilled I2V model: the flow shifts and CFG scales no flag sets come from its
    scheduler and guider configs (7 and 1: one forward, no negative branch) and are printed; a flag the user set
    stays and warns; GRPO on it is allowed with a warning that says why it is questionable; its SDE rollout (with
    timestep_r) re-scores to the rollout's log-probs bitwise."""
    import numpy as np
    import PIL.Image
    from post_train_helpers import _args, pt

    from sage_grpo.config import load_config
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint
    from sage_grpo.parallel.dist import init_distributed
    from sage_grpo.rollout import policy_step

    model = write_tiny_checkpoint(tmp_path / "sd" / "hv", seed=0, version="480p_i2v_step_distilled")
    g = np.random.default_rng(0)
    PIL.Image.fromarray((g.random((36, 64, 3)) * 255).astype(np.uint8)).save(tmp_path / "a.png")
    (tmp_path / "p.csv").write_text("prompt,ref_image_path\na red ball rolls,a.png\n")
    cfg = load_config(_args(model, tmp_path / "run", "--train_video_csv", str(tmp_path / "p.csv"),
                            "--grpo_sampling_steps", "3", "--validation_timestep_shift", "5"))
    c, state = pt.setup(cfg, init_distributed(), None)
    shown = capsys.readouterr().out
    assert (cfg.rollout.flow_shift, cfg.rollout.cfg_scale, cfg.validation.validation_guidance_scale) == (7, 1, 1)
    assert cfg.validation.validation_timestep_shift == 5  # set by the user: kept
    assert (c.settings.shift, c.settings.cfg_scale, c.val_settings.shift) == (7, 1, 5)
    assert ("from the checkpoint's scheduler/guider configs: --flow_shift 7, --cfg_scale 1, "
            "--validation_guidance_scale 1") in shown
    assert "--validation_timestep_shift 5 differs from the checkpoint's own default 7" in shown
    assert "GRPO on the step-distilled (MeanFlow) checkpoint is questionable" in shown
    traj = pt.rollout_phase(c, state)
    assert traj.uncond is None  # guidance 1: one forward
    with torch.no_grad():
        for chunk in torch.arange(traj.batch_size).split(cfg.optim.mini_batch_size_per_update):
            for step in range(3):
                out = policy_step(c.transformer, traj, chunk, step, c.pipe.vision_num_semantic_tokens)
                assert torch.equal(out.log_prob, traj.log_probs[chunk, step])


def test_generate_takes_the_checkpoints_defaults_unless_set(tmp_path, capsys):
    import numpy as np
    import PIL.Image

    import generate
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint
    from sage_grpo.video import read_video

    model = write_tiny_checkpoint(tmp_path / "sd", seed=0, version="480p_i2v_step_distilled")
    PIL.Image.fromarray((np.random.default_rng(0).random((36, 64, 3)) * 255).astype(np.uint8)).save(tmp_path / "a.png")
    [path] = generate.main(["--model_path", str(model), "--prompt", "a red ball rolls", "--image",
                            str(tmp_path / "a.png"), "--video_length", "5", "--num_inference_steps", "2",
                            "--cfg_scale", "1", "--output_path", str(tmp_path / "v.mp4")])
    shown = capsys.readouterr().out
    assert "from the checkpoint's scheduler/guider configs: --flow_shift 7" in shown and "differs" not in shown
    assert read_video(path)[0].shape == (5, 3, 24, 40)
    meta = json.loads(path.with_name("v_config.json").read_text())
    assert (meta["flow_shift"], meta["cfg_scale"]) == (7, 1)
    # a flag the user set stays, with a warning
    generate.main(["--model_path", str(model), "--prompt", "a red ball rolls", "--image", str(tmp_path / "a.png"),
                   "--video_length", "5", "--num_inference_steps", "2", "--flow_shift", "5",
                   "--output_path", str(tmp_path / "w.mp4")])
    shown = capsys.readouterr().out
    assert "--flow_shift 5 differs from the checkpoint's own default 7" in shown
    assert "--cfg_scale 1" in shown  # not set: the checkpoint's guidance 1
    assert json.loads((tmp_path / "w_config.json").read_text())["flow_shift"] == 5


def test_preflight_resolves_the_checkpoints_defaults_before_any_model_loads(tmp_path):
    """preflight (no model loaded) reads a located checkpoint's scheduler/guider configs into the config the run
    then builds its sampler settings from and saves: 720p T2V -> shift 9; a CFG-distilled model -> guidance 1;
    the tiny default's 5 / 6 leave a config unchanged; a YAML key counts as set by the user."""
    from post_train_helpers import ROOT, _args, pt

    from sage_grpo.config import load_config
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    cases = {"720p_t2v": (9.0, 6.0), "480p_t2v_distilled": (5.0, 1.0), "480p_t2v": (5.0, 6.0)}
    for version, (shift, scale) in cases.items():
        model = write_tiny_checkpoint(tmp_path / version / "hv", seed=0, version=version)
        cfg = load_config(_args(model, tmp_path / version / "run"))
        pt.preflight(cfg, 1)
        assert (cfg.rollout.flow_shift, cfg.rollout.cfg_scale) == (shift, scale), version
        assert (cfg.validation.validation_timestep_shift, cfg.validation.validation_guidance_scale) == (shift, scale)
    yaml = tmp_path / "c.yaml"  # the tiny config with the rollout's shift set in the YAML
    yaml.write_text((ROOT / "configs/tiny_cpu.yaml").read_text().replace("rollout:\n", "rollout:\n  flow_shift: 3\n"))
    argv = _args(tmp_path / "720p_t2v" / "hv", tmp_path / "y")
    cfg = load_config(["--config", str(yaml), *argv[2:]])
    pt.preflight(cfg, 1)
    assert cfg.rollout.flow_shift == 3 and cfg.validation.validation_timestep_shift == 9
