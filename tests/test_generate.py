"""generate.py end to end on the tiny checkpoint: mp4 frame count and size, config json, prompt files, errors."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sage_grpo.video import read_video, write_video

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def test_video_roundtrip(tmp_path):
    frames = torch.linspace(0, 1, 5).reshape(5, 1, 1, 1).expand(5, 3, 16, 24).contiguous()  # flat grey ramp
    write_video(tmp_path / "v.mp4", frames, fps=24)
    back, fps = read_video(tmp_path / "v.mp4")
    assert back.shape == (5, 3, 16, 24) and fps == 24.0
    assert (back - frames).abs().mean() < 0.02


def test_generate_one_prompt_and_a_prompt_file(tiny_diffusers_dir, tmp_path):
    import generate

    common = ["--model_path", str(tiny_diffusers_dir), "--dtype", "fp32", "--video_length", "5", "--fixed_size",
              "16x32", "--num_inference_steps", "3"]
    [path] = generate.main([*common, "--prompt", "a red ball rolls", "--output_path", str(tmp_path / "one.mp4")])
    frames, fps = read_video(path)
    assert path == tmp_path / "one.mp4" and frames.shape == (5, 3, 16, 32) and fps == 24.0
    meta = json.loads((tmp_path / "one_config.json").read_text())
    assert meta["prompt"] == "a red ball rolls" and meta["sampler"] == "ode" and meta["layout"] == "diffusers"
    # Same seed -> same video; the SDE sampler draws noise -> a different one.
    [again] = generate.main([*common, "--prompt", "a red ball rolls", "--output_path", str(tmp_path / "two.mp4")])
    assert torch.equal(read_video(again)[0], frames)
    # --overwrite replaces a video (without it: test_existing_videos_are_refused_before_any_model_loads)
    generate.main([*common, "--prompt", "a red ball rolls", "--seed", "1", "--output_path", str(again), "--overwrite"])
    assert not torch.equal(read_video(again)[0], frames)
    (tmp_path / "p.csv").write_text("prompt,seed\na cat,1\na dog,2\n")
    out = generate.main([*common, "--valid_video_csv", str(tmp_path / "p.csv"), "--output_path", str(tmp_path / "dir"),
                         "--sampler", "sage_grpo", "--eta", "0.5"])
    assert [p.name for p in out] == ["0000_a_cat.mp4", "0001_a_dog.mp4"]
    assert all(p.with_name(p.stem + "_config.json").is_file() for p in out)


ERRORS = [
        (["--prompt", "x", "--model_path", "/nonexistent/weights"], "download_weights.sh"),
        (["--prompt_file", "/nonexistent.csv"], "prompt file not found"),
        (["--prompt", "x", "--fixed_size", "big"], "--fixed_size must be HxW"),
        (["--prompt", "x", "--eta", "0.3"], "--eta applies to SDE samplers"),
        (["--prompt", "x", "--sampler", "sage_grpo", "--eta", "0"], "needs --eta > 0"),
        (["--prompt", "x", "--prompt", "y", "--output_path", "o.mp4"], "give a directory"),
        (["--prompt", "x", "--sampler", "sage_grpo", "--num_inference_steps", "100"], "use fewer steps"),
]


@pytest.mark.parametrize("extra, match", ERRORS)
def test_user_errors_are_one_line_and_exit_2(extra, match, capsys):
    """Through run_cli, as generate.py's `__main__` calls main: exit 2 and the one `error:` line (the process itself:
    test_a_user_error_ends_the_process_with_its_line)."""
    import generate
    from sage_grpo.errors import run_cli

    with pytest.raises(SystemExit) as e:
        run_cli(generate.main, extra)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert match in err, err


@pytest.mark.slow
def test_a_user_error_ends_the_process_with_its_line():
    """As a user runs it (one process; the messages of every user and flag error: the in-process tests): exit 2, the
    one `error:` line, no traceback."""
    for extra, match in (ERRORS[0], (["--prompt", "x", "--model_path", "/nonexistent", "--fixed_size", "33x33"],
                                     "--fixed_size height must be a positive multiple of 16")):
        r = subprocess.run([sys.executable, str(REPO / "generate.py"), *extra], capture_output=True, text=True,
                           cwd=REPO, timeout=120)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and match in r.stderr, (extra, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_sde_sampler_without_eta_uses_the_rollout_eta():
    import generate

    args = generate.resolve_args(generate.build_parser().parse_args(["--prompt", "x", "--sampler", "sage_grpo"]))
    assert args.eta == 0.5  # RolloutConfig.eta: an SDE sampler at eta 0 would silently be the ODE
    assert generate.resolve_args(generate.build_parser().parse_args(["--prompt", "x"])).eta == 0.0


def test_prompt_and_file_indices_do_not_collide(tmp_path):
    import generate

    (tmp_path / "p.txt").write_text("a cat\na dog\n")
    args = generate.resolve_args(generate.build_parser().parse_args(
        ["--prompt", "x", "--prompt_file", str(tmp_path / "p.txt"), "--output_path", str(tmp_path / "out")]))
    assert [r.index for r in generate._prompts(args)] == [0, 1, 2]


def test_text_encoders_are_freed_once_prompts_are_cached_before_the_transformer_loads(tiny_diffusers_dir, tmp_path,
                                                                                      monkeypatch):
    import generate
    from sage_grpo.models import loading
    from sage_grpo.models.text_cache import TextEmbeddingCache

    events = []
    release, load = TextEmbeddingCache.release_encoders, loading.load_transformer

    def spy_release(self, *a, **k):
        events.append(("release", len(self)))  # how many prompts were cached when the encoders were freed
        release(self, *a, **k)

    def spy_load(*a, **k):
        events.append(("transformer",))
        return load(*a, **k)

    monkeypatch.setattr(TextEmbeddingCache, "release_encoders", spy_release)
    monkeypatch.setattr(loading, "load_transformer", spy_load)
    common = ["--model_path", str(tiny_diffusers_dir), "--dtype", "fp32", "--video_length", "5", "--fixed_size",
              "16x32", "--num_inference_steps", "2", "--prompt", "a", "--prompt", "b", "--output_path", str(tmp_path)]
    generate.main(common)
    # two prompts + the empty negative prompt, then freed (model.offload_text_encoder: true), then the transformer
    assert events == [("release", 3), ("transformer",)]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  offload_text_encoder: false\n")
    generate.main([*common, "--config", str(cfg), "--output_path", str(tmp_path / "2")])
    assert events == [("release", 3), ("transformer",), ("transformer",)]


# ------------------------------------------------------------------------------------------------ flag checks
# Every flag is checked (with the config's rules) before any model loads: each case also names a model path that
# does not exist, so reaching the loader would give the "download_weights.sh" error instead of the flag's own.
FLAG_ERRORS = [
    (["--num_inference_steps", "0"], "--num_inference_steps must be >= 1"),
    (["--num_inference_steps", "-3"], "--num_inference_steps must be >= 1"),
    (["--num_inference_steps", "x"], "--num_inference_steps: invalid int value"),
    (["--video_length", "10"], "--video_length must be 4k + 1"),
    (["--video_length", "0"], "--video_length must be 4k + 1"),
    (["--fixed_size", "33x33"], "--fixed_size height must be a positive multiple of 16"),
    (["--fixed_size", "0x32"], "--fixed_size height must be a positive multiple of 16"),
    (["--fixed_size", "40x40"], "--fixed_size height must be a positive multiple of 16"),
    (["--flow_shift", "0"], "--flow_shift must be > 0"),
    (["--sampler", "sage_grpo", "--eta", "50"], "--eta must be in (0, 1]"),
    (["--sampler", "cps", "--eta", "2"], "--eta must be in (0, 1]"),
    (["--cfg_scale", "-3"], "--cfg_scale must be >= 1"),
    (["--fps", "0"], "--fps must be >= 1"),
    (["--seed", str(2**64)], "--seed must fit in a signed 64-bit integer"),
    (["--sage_sigma_clamp", "0.99"], "--sage_sigma_clamp applies to --sampler sage_grpo"),
    (["--sampler", "sage_grpo", "--sage_sigma_clamp", "1.5"], "--sage_sigma_clamp must be in (0, 1)"),
    (["--output_path", "x.mkv"], "only .mp4 videos are written"),
    (["--checkpoint_path", "/nonexistent/checkpoint-1/transformer"], "--checkpoint_path /nonexistent"),
    (["--lora_path", "/nonexistent/lora.safetensors"], "--lora_path /nonexistent"),
    (["--offload_text_encoder", "maybe"], "--offload_text_encoder: 'maybe' is not a boolean"),
    (["--num_inferenc", "3"], "unrecognized arguments"),
    (["--sp_size", "0"], "--sp_size must be >= 1"),
    (["--sp_size", "2"], "--sp_size 2 must divide the number of processes 1"),  # one process, no torchrun
    (["--attention_backend", "flash"], "--attention_backend flash cannot run generation here: not installed"),
    (["--attention_backend", "fast"], "invalid choice: 'fast'"),
]


@pytest.fixture()
def no_model_load(monkeypatch):
    """Fail the test if anything tries to load the pipeline."""
    import sage_grpo.models.loading as loading

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(loading, "load_pipeline", refuse)


@pytest.mark.parametrize("extra, match", FLAG_ERRORS)
def test_flag_values_are_checked_before_any_model_loads(extra, match, tmp_path, no_model_load):
    import generate
    from sage_grpo.errors import SageGRPOError

    argv = ["--prompt", "x", "--model_path", "/nonexistent/weights", "--output_path", str(tmp_path / "out"), *extra]
    with pytest.raises(SageGRPOError, match=re.escape(match)) as e:
        generate.main(argv)
    assert "\n" not in str(e.value)  # run_cli prints it as the one `error:` line


def test_empty_prompt_and_duplicate_indices(tmp_path, no_model_load):
    import generate
    from sage_grpo.errors import SageGRPOError

    with pytest.raises(SageGRPOError, match="--prompt is empty"):
        generate.main(["--prompt", " ", "--output_path", str(tmp_path)])
    (tmp_path / "p.csv").write_text("prompt,index\na cat,3\na dog,3\n")
    with pytest.raises(SageGRPOError, match="index 3 is used twice"):
        generate.main(["--prompt_file", str(tmp_path / "p.csv"), "--output_path", str(tmp_path)])


def test_unwritable_output_is_found_before_loading(tmp_path, no_model_load):
    import generate
    from sage_grpo.errors import SageGRPOError

    (tmp_path / "file").write_text("")
    for out, match in ((tmp_path / "file" / "videos", "is a file, not a folder"),
                       (tmp_path / "file" / "v.mp4", "is a file, not a folder"),
                       ("/proc/sage_grpo_out", "is not writable")):
        with pytest.raises(SageGRPOError, match=match):
            generate.main(["--prompt", "x", "--output_path", str(out)])


def test_a_failed_generate_leaves_no_output_folder(tmp_path):
    """A command that fails (here: no model at --model_path) makes no --output_path folder: an empty outputs/gen
    was then the next command's "no .mp4 files in outputs/gen"."""
    import generate
    from sage_grpo.errors import SageGRPOError

    for out in (tmp_path / "gen", tmp_path / "one" / "v.mp4"):
        with pytest.raises(SageGRPOError, match="no HunyuanVideo-1.5 checkpoint"):
            generate.main(["--prompt", "x", "--model_path", str(tmp_path / "none"), "--output_path", str(out)])
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("broken", ["no_binary", "not_installed"])
def test_missing_ffmpeg_is_named_before_sampling(broken, tmp_path, monkeypatch, no_model_load):
    import imageio_ffmpeg

    import generate
    from sage_grpo.errors import SageGRPOError

    if broken == "no_binary":
        def no_exe():
            raise RuntimeError("No ffmpeg exe could be found. Install ffmpeg on your system")

        monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", no_exe)
    else:
        monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    with pytest.raises(SageGRPOError, match=r"mp4 files need ffmpeg support.*pip install imageio-ffmpeg"):
        generate.main(["--prompt", "x", "--output_path", str(tmp_path / "o.mp4")])


def test_sage_clamp_of_the_config_is_honoured(tmp_path, monkeypatch, tiny_diffusers_dir):
    """rollout.sage_sigma_clamp (YAML) and --sage_sigma_clamp reach the schedule check and the sampler settings."""
    import generate
    import sage_grpo.generation as generation
    from sage_grpo.errors import SageGRPOError

    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout:\n  sage_sigma_clamp: 0.99\n")
    base = ["--prompt", "x", "--sampler", "sage_grpo", "--output_path", str(tmp_path / "o")]
    with pytest.raises(SageGRPOError, match="sage_sigma_clamp 0.99"):  # 40 steps, shift 5: sigma_1 = 0.9949 > 0.99
        generate.main([*base, "--config", str(cfg)])
    seen = []

    def spy(pipe, cache, records, *, settings, **kw):
        seen.append(settings)
        return iter(())

    monkeypatch.setattr(generation, "sample_videos", spy)
    tiny = ["--model_path", str(tiny_diffusers_dir), "--dtype", "fp32", "--video_length", "5", "--fixed_size", "16x32"]
    generate.main([*base, *tiny, "--config", str(cfg), "--num_inference_steps", "4"])
    generate.main([*base, *tiny, "--sage_sigma_clamp", "0.9999", "--num_inference_steps", "4"])
    assert [s.sage_clamp for s in seen] == [0.99, 0.9999] and seen[0].sde_type == "sage_grpo"


def test_cache_and_offload_flags_are_accepted():
    import generate

    args = generate.resolve_args(generate.build_parser().parse_args(
        ["--prompt", "x", "--text_embedding_cache_dir", "/tmp/te", "--offload_text_encoder", "false"]))
    assert args.text_embedding_cache_dir == "/tmp/te" and args.offload_text_encoder is False
    args = generate.resolve_args(generate.build_parser().parse_args(["--prompt", "x"]))
    assert args.text_embedding_cache_dir == "" and args.offload_text_encoder is True


def test_generate_then_score_keeps_prompts_and_fps(tiny_diffusers_dir, tmp_path):
    """generate writes <name>.txt with the exact prompt and the asked fps; score_videos scores that prompt."""
    import csv
    import importlib.util

    import generate

    prompts = ["a dog, running", "  Ünïcode prompt: 狗 "]
    argv = ["--model_path", str(tiny_diffusers_dir), "--dtype", "fp32", "--video_length", "5", "--fixed_size", "16x32",
            "--num_inference_steps", "2", "--fps", "12", "--output_path", str(tmp_path / "gen")]
    paths = generate.main([*argv, *[x for p in prompts for x in ("--prompt", p)]])
    assert [p.with_suffix(".txt").read_text(encoding="utf-8") for p in paths] == [p + "\n" for p in prompts]
    assert all(read_video(p)[1] == 12.0 for p in paths)
    assert json.loads(paths[0].with_name(paths[0].stem + "_config.json").read_text())["fps"] == 12
    spec = importlib.util.spec_from_file_location("score_videos", REPO / "scripts" / "score_videos.py")
    sv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sv)
    out = tmp_path / "scores"
    assert sv.main(["--videos", str(tmp_path / "gen"), "--out", str(out), "--metrics", "brightness", "--device", "cpu",
                    "--video_fps", "12"]) == 0
    rows = list(csv.DictReader(out.with_suffix(".csv").open(encoding="utf-8")))
    assert [r["prompt"] for r in rows[:-1]] == prompts


@pytest.mark.slow
def test_quiet_by_default_verbose_on_request(tiny_diffusers_dir, tmp_path):
    argv = [sys.executable, str(REPO / "generate.py"), "--model_path", str(tiny_diffusers_dir), "--dtype", "fp32",
            "--video_length", "5", "--fixed_size", "16x32", "--num_inference_steps", "2", "--prompt", "x"]
    quiet = subprocess.run([*argv, "--output_path", str(tmp_path / "q")], capture_output=True, text=True, cwd=REPO,
                           timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert "Guiders" not in quiet.stderr and "Loading weights" not in quiet.stderr and "rollout" not in quiet.stderr
    loud = subprocess.run([*argv, "--output_path", str(tmp_path / "v"), "--verbose"], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert loud.returncode == 0 and "Guiders" in loud.stderr and "rollout" in loud.stderr


def test_a_checkpoint_path_that_is_no_checkpoint_is_one_line_before_any_model_loads(tmp_path, no_model_load):
    """--checkpoint_path takes a DCP checkpoint or an exported transformer folder; a folder that is neither, and an
    export of a LoRA run's unmerged base weights without its adapter, are refused before the model loads."""
    import generate
    from sage_grpo.errors import SageGRPOError

    argv = ["--prompt", "x", "--model_path", "/nonexistent/weights", "--output_path", str(tmp_path / "out")]
    junk = tmp_path / "outputs"
    (junk / "checkpoint-3").mkdir(parents=True)
    for path in (junk, junk / "checkpoint-3"):
        with pytest.raises(SageGRPOError, match=rf"--checkpoint_path '{path}' is neither a training checkpoint "
                           r"\(output_dir/checkpoint-N or its transformer/, written by post_train.py\) nor an "
                           r"exported transformer \(config.json \+ diffusion_pytorch_model.safetensors"):
            generate.main([*argv, "--checkpoint_path", str(path)])
    unmerged = tmp_path / "exp"
    (unmerged / "lora").mkdir(parents=True)
    (unmerged / "config.json").write_text("{}")
    (unmerged / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    with pytest.raises(SageGRPOError, match=re.escape(f"adapter unmerged in {unmerged / 'lora'}: add --lora_path "
                                                      f"{unmerged / 'lora'}")):
        generate.main([*argv, "--checkpoint_path", str(unmerged)])
    # with the adapter named the checks pass and the model would load next (no_model_load refuses it)
    with pytest.raises(AssertionError, match="a model was loaded"):
        generate.main([*argv, "--checkpoint_path", str(unmerged), "--lora_path", str(unmerged / "lora")])


# the sampling settings of the runs below (their saved config): a tiny video in seconds
RUN_SETTINGS = dict(dtype="fp32", validation_fixed_size="16x32", validate_video_length=5,
                    validation_num_inference_steps=2)


def test_a_training_checkpoint_samples_on_its_runs_base_model_with_its_settings(tiny_diffusers_dir, tmp_path):
    """--checkpoint_path of a training run needs neither --config nor --model_path: the checkpoint's saved config is
    the defaults (its base model, dtype, size, steps), the video the one --config of the run's config and its base
    named give."""
    from helpers import lora_checkpoint

    import generate
    from sage_grpo.config import config_from_dict, dump_yaml

    ckpt = lora_checkpoint(tmp_path / "run", tiny_diffusers_dir, **RUN_SETTINGS)
    [path] = generate.main(["--checkpoint_path", str(ckpt), "--prompt", "a red ball rolls", "--output_path",
                            str(tmp_path / "v.mp4")])
    meta = json.loads((tmp_path / "v_config.json").read_text())
    assert meta["weights"] == str(tiny_diffusers_dir) and meta["dtype"] == "fp32" and meta["num_inference_steps"] == 2
    frames = read_video(path)[0]
    assert frames.shape == (5, 3, 16, 32)
    run_yaml = tmp_path / "config.yaml"  # what post_train.py writes beside the checkpoints
    dump_yaml(config_from_dict(json.loads((ckpt / "train_state.json").read_text())["config"]), run_yaml)
    [named] = generate.main(["--config", str(run_yaml), "--model_path", str(tiny_diffusers_dir), "--checkpoint_path",
                             str(ckpt), "--prompt", "a red ball rolls", "--output_path", str(tmp_path / "w.mp4")])
    assert torch.equal(read_video(named)[0], frames)


def test_a_base_model_that_is_not_the_runs_is_one_line_before_any_model_loads(tiny_diffusers_dir, tiny_model,
                                                                              tmp_path, capsys, no_model_load):
    """Another base named for a training checkpoint (by a flag or by --config; the same shapes would load and sample
    silently) and a run whose base model is gone are refused in one line, exit 2."""
    from helpers import lora_checkpoint

    import generate
    from sage_grpo.errors import run_cli

    ckpt = lora_checkpoint(tmp_path / "run", tiny_diffusers_dir, **RUN_SETTINGS)
    cfg = tmp_path / "other.yaml"
    cfg.write_text(f"model:\n  model_path: {tiny_model}\n")
    gone = lora_checkpoint(tmp_path / "gone", tmp_path / "moved", transformer=_tiny_transformer())
    base = f"was trained on {tiny_diffusers_dir} (text-to-video), not on {tiny_model} (text-to-video)"
    cases = [(["--checkpoint_path", str(ckpt), "--model_path", str(tiny_model)], f"{base} (--model_path); leave out "
              "--model_path to sample on the run's base model"),
             (["--checkpoint_path", str(ckpt), "--config", str(cfg)], f"{base} (model.model_path of --config {cfg})"),
             (["--checkpoint_path", str(gone)], f"the base model of its run, '{tmp_path / 'moved'}' (saved in "
              f"{gone / 'train_state.json'}), is not there or incomplete; pass --model_path where it is now")]
    for argv, match in cases:
        with pytest.raises(SystemExit) as e:
            run_cli(generate.main, [*argv, "--prompt", "x", "--output_path", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and match in err, err
    # the run's base named where it is now: the checks pass and the model would load next (no_model_load refuses it)
    with pytest.raises(AssertionError, match="a model was loaded"):
        generate.main(["--checkpoint_path", str(gone), "--model_path", str(tiny_model), "--prompt", "x"])


def test_a_checkpoint_of_another_base_version_samples_and_exports_on_that_version(tmp_path, capsys):
    """A run on another version than the default 480p_t2v (an authors' root holding 720p_t2v alone, whose scheduler
    shift is 9, not 5): --checkpoint_path samples on the run's version with that version's defaults, and the merged
    export of the checkpoint loads the same version's weights and gives the same video (both find the run's base
    through sage_grpo.checkpoint.run_base; read as the default version, the run's base is "not there")."""
    from helpers import load_script, lora_checkpoint

    import generate
    from sage_grpo.config import config_from_dict, dump_yaml
    from sage_grpo.models.loading import load_transformer, locate_model
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    version = "720p_t2v"
    root = write_tiny_checkpoint(tmp_path / "ckpts", "authors", seed=0, version=version)
    assert not (root / "transformer" / "480p_t2v").exists()
    tr = load_transformer(locate_model(str(root), "", version), torch.float32)
    ckpt = lora_checkpoint(tmp_path / "run", None, transformer=tr, pretrained_model_root=str(root),
                           pretrained_transformer_version=version, **RUN_SETTINGS)
    [path] = generate.main(["--checkpoint_path", str(ckpt), "--prompt", "a red ball rolls", "--output_path",
                            str(tmp_path / "v.mp4")])
    meta = json.loads((tmp_path / "v_config.json").read_text())
    assert meta["pretrained_transformer_version"] == version and meta["weights"] == str(root), meta
    assert meta["layout"] == "authors" and "its run's settings and base model" in capsys.readouterr().out
    export = load_script("scripts/export_checkpoint.py")
    merged = export.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "merged")])
    run_yaml = tmp_path / "config.yaml"  # the run's settings and base, what post_train.py writes beside checkpoints
    dump_yaml(config_from_dict(json.loads((ckpt / "train_state.json").read_text())["config"]), run_yaml)
    [again] = generate.main(["--config", str(run_yaml), "--checkpoint_path", str(merged), "--prompt",
                             "a red ball rolls", "--output_path", str(tmp_path / "w.mp4")])
    assert torch.equal(read_video(again)[0], read_video(path)[0])


def _tiny_transformer():
    from diffusers import HunyuanVideo15Transformer3DModel

    from sage_grpo.models.tiny import tiny_transformer_config

    return HunyuanVideo15Transformer3DModel(**tiny_transformer_config())


def test_existing_videos_are_refused_before_any_model_loads(tmp_path, no_model_load):
    """A video at an output path (e.g. the trained model's, before the base model's run) is never replaced silently:
    one line naming it and --overwrite; with --overwrite the checks pass."""
    import generate
    from sage_grpo.errors import SageGRPOError

    (tmp_path / "v.mp4").write_bytes(b"the trained model's video")
    (tmp_path / "dir").mkdir()
    for name in ("0000_a_cat.mp4", "0001_a_dog.mp4", "0002_other.mp4"):
        (tmp_path / "dir" / name).write_bytes(b"")
    cases = [(["--prompt", "x", "--output_path", str(tmp_path / "v.mp4")], f"--output_path {tmp_path / 'v.mp4'} "
              "already exists; choose another --output_path, or pass --overwrite to replace it"),
             (["--prompt", "a cat", "--prompt", "a dog", "--prompt", "a cow", "--output_path", str(tmp_path / "dir")],
              f"--output_path {tmp_path / 'dir'}: 0000_a_cat.mp4 and 1 more of these prompts' videos already exist; "
              "choose another --output_path, or pass --overwrite to replace them")]
    for argv, match in cases:
        with pytest.raises(SageGRPOError, match=re.escape(match)):
            generate.main(argv)
        with pytest.raises(AssertionError, match="a model was loaded"):
            generate.main([*argv, "--overwrite"])
    assert (tmp_path / "v.mp4").read_bytes() == b"the trained model's video"
