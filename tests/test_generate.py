"""generate.py end to end on the tiny checkpoint: mp4 frame count and size, config json, prompt files, errors."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hv_fixtures import *  # noqa: F401,F403

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

    common = ["--model_path", str(tiny_diffusers_dir), "--dtype", "fp32", "--video_length", "5", "--fixed_size", "16x32",
              "--num_inference_steps", "3"]
    [path] = generate.main([*common, "--prompt", "a red ball rolls", "--output_path", str(tmp_path / "one.mp4")])
    frames, fps = read_video(path)
    assert path == tmp_path / "one.mp4" and frames.shape == (5, 3, 16, 32) and fps == 24.0
    meta = json.loads((tmp_path / "one_config.json").read_text())
    assert meta["prompt"] == "a red ball rolls" and meta["sampler"] == "ode" and meta["layout"] == "diffusers"
    # Same seed -> same video; the SDE sampler draws noise -> a different one.
    [again] = generate.main([*common, "--prompt", "a red ball rolls", "--output_path", str(tmp_path / "two.mp4")])
    assert torch.equal(read_video(again)[0], frames)
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
def test_user_errors_raise_sage_error(extra, match):
    import generate
    from sage_grpo.errors import SageGRPOError

    with pytest.raises(SageGRPOError, match=re.escape(match)):
        generate.main(extra)


@pytest.mark.slow
@pytest.mark.parametrize("extra, match", ERRORS)
def test_user_errors_are_one_line(extra, match):
    r = subprocess.run([sys.executable, str(REPO / "generate.py"), *extra], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode != 0 and match in r.stderr and "Traceback" not in r.stderr


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


def test_text_encoders_are_offloaded_once_prompts_are_cached(tiny_diffusers_dir, tmp_path, monkeypatch):
    import generate
    from sage_grpo.models.text_cache import TextEmbeddingCache

    calls = []
    original = TextEmbeddingCache.offload_encoders

    def spy(self):
        calls.append(len(self))  # how many prompts were cached when the encoders left
        original(self)

    monkeypatch.setattr(TextEmbeddingCache, "offload_encoders", spy)
    common = ["--model_path", str(tiny_diffusers_dir), "--dtype", "fp32", "--video_length", "5", "--fixed_size",
              "16x32", "--num_inference_steps", "2", "--prompt", "a", "--prompt", "b", "--output_path", str(tmp_path)]
    generate.main(common)
    assert calls == [3]  # two prompts + the empty negative prompt, then offload (model.offload_text_encoder: true)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  offload_text_encoder: false\n")
    generate.main([*common, "--config", str(cfg)])
    assert calls == [3]
