"""Quality measures of a world model (sage_grpo.world.evaluate) and scripts/eval_tiny.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from world_fixtures import blur

from sage_grpo.world import parse_caption, render_caption
from sage_grpo.world.evaluate import eval_captions, first_frame_error, quality, sharpness, write_first_frames
from sage_grpo.world.sampler import is_heldout, single_object_attributes

ROOT = Path(__file__).resolve().parents[1]


def test_eval_captions_spread_over_the_heldout_grid():
    caps = eval_captions(12)
    attrs = [parse_caption(c) for c in caps]
    assert len(set(caps)) == 12 and all(is_heldout(a) for a in attrs)
    assert caps[0] == eval_captions(1)[0]  # a fixed order: the first is always the grid's first
    assert len({a.objects[0].color for a in attrs}) >= 4 and len({a.motion for a in attrs}) >= 3
    with pytest.raises(ValueError, match="one-object captions"):
        eval_captions(len(single_object_attributes("heldout")) + 1)


def test_quality_of_rendered_clips_is_perfect_and_blur_lowers_sharpness():
    caps = eval_captions(6)
    videos = torch.stack([render_caption(c, seed=s) for s, c in enumerate(caps)])
    q = quality(videos, caps, seeds=list(range(6)))
    for k in ("color", "shape", "motion", "size", "background"):
        assert q[k] == 1.0, k
    assert q["sharpness_ratio"] == pytest.approx(1.0) and q["videos"] == 6
    blurred = torch.stack([blur(v) for v in videos])
    assert (sharpness(blurred) < sharpness(videos)).all()
    wrong = quality(videos.flip(0), caps, seeds=list(range(6)))  # each video scored against another caption
    assert wrong["color"] < 1.0 and wrong["agreement"] < q["agreement"]


def test_first_frames_are_the_rendered_clips_first_frames_and_score_zero_error(tmp_path):
    import numpy as np
    import PIL.Image

    caps, seeds = eval_captions(3), [0, 1, 2]
    paths, frames = write_first_frames(caps, seeds, tmp_path / "ff")
    videos = torch.stack([render_caption(c, seed=s) for c, s in zip(caps, seeds)])  # [3, F, 3, H, W]
    for path, frame, video in zip(paths, frames, videos):
        png = torch.from_numpy(np.asarray(PIL.Image.open(path), dtype=np.float32) / 255).permute(2, 0, 1)
        assert torch.equal(png, frame)  # what the PNG holds is what the error compares with
        assert (frame - video[0]).abs().max() <= 0.5 / 255 + 1e-6  # the rendered first frame, to uint8 rounding
    assert first_frame_error(videos, frames).max() <= 0.5 / 255 + 1e-6
    moved = first_frame_error(videos[:, 1:], frames)  # the second frame: the object has moved
    other = first_frame_error(videos.roll(1, 0), frames)  # another caption's video
    assert (moved > 1e-3).all() and (other > moved).all()


def test_centred_first_frames_put_the_rendered_object_at_the_centre(tmp_path):
    """--centred: the same object (its pixels, moved) with its centroid at the frame centre; the rendered first frame
    of a "moves right" caption has its object left of the centre (room to travel), so the position hints at the
    direction there and not here. A two-object caption cannot be centred."""
    from sage_grpo.errors import SageGRPOError
    from sage_grpo.world.detectors import detect
    from sage_grpo.world.evaluate import first_frame

    caption = "a small red square moves right on a blue background"
    rendered, centred = first_frame(caption, 3), first_frame(caption, 3, centred=True)
    x_rendered = detect(rendered[None]).objects[0].track[0]
    x_centred = detect(centred[None]).objects[0].track[0]
    assert x_rendered[0] < 16 - 2 and torch.allclose(x_centred, torch.tensor([15.5, 15.5], dtype=x_centred.dtype),
                                                      atol=0.6)
    background = rendered[:, 0, 0].view(3, 1, 1)  # a corner: the object is never there
    mass = [float((f - background).abs().sum()) for f in (rendered, centred)]  # the object's colour x coverage
    assert mass[1] == pytest.approx(mass[0], rel=0.02)  # the same object, moved (edges anti-aliased anew)
    paths, frames = write_first_frames([caption], [3], tmp_path / "c", centred=True)
    assert (frames[0] - centred).abs().max() <= 0.5 / 255 + 1e-6
    with pytest.raises(SageGRPOError, match="one-object caption"):
        first_frame("a small red square and a large blue circle move right on a white background", 0, centred=True)


def test_quality_splits_the_direction_share_by_object_size():
    """motion_small / motion_large: the direction share over the captions with a small / a large object."""
    from sage_grpo.world.metrics import caption_scores

    caps = eval_captions(12)
    videos = torch.stack([render_caption(c, seed=i) for i, c in enumerate(caps)])
    videos[::3] = videos[::3].flip(1)  # every third clip runs backwards: the wrong direction
    q = quality(videos, caps, seeds=list(range(12)))
    right = caption_scores(videos, caps)["motion"]
    for size in ("small", "large"):
        idx = [i for i, c in enumerate(caps) if f"a {size} " in c]
        assert idx and q[f"motion_{size}"] == pytest.approx(float(right[idx].float().mean()))
    assert q["motion_small"] < 1 or q["motion_large"] < 1


def _eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "eval_tiny.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def _eval_script():
    """scripts/eval_tiny.py as a module (its main, which raises SageGRPOError for run_cli to print)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_tiny", ROOT / "scripts" / "eval_tiny.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.slow
def test_eval_tiny_missing_model_file_is_one_line(tiny_diffusers_dir, tmp_path):
    """As a user runs it (one process): exit 2, the `error:` line and the folder's listing, no traceback."""
    broken = tmp_path / "model"
    shutil.copytree(tiny_diffusers_dir, broken)
    (broken / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    r = _eval("--model_path", str(broken), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "transformer" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 3  # the message and its list


@pytest.mark.parametrize(("extra", "message"), [
    (["--num_captions", "100000"], "one-object captions"),
    (["--i2v"], "is a text-to-video checkpoint; drop --i2v"),
    (["--centred"], "--centred places the first frame's object: it needs --i2v")])
def test_eval_tiny_flag_errors_are_one_message(tiny_diffusers_dir, tmp_path, extra, message):
    """The messages of eval_tiny.py's other user errors (in this process: main raises what run_cli prints as the
    one `error:` line of the test above)."""
    from sage_grpo.errors import SageGRPOError

    with pytest.raises(SageGRPOError, match=re.escape(message)) as e:
        _eval_script().main(["--model_path", str(tiny_diffusers_dir), *extra, "--out", str(tmp_path / "o")])
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_eval_tiny_writes_its_report(tiny_diffusers_dir, tmp_path):
    r = _eval("--model_path", str(tiny_diffusers_dir), "--num_captions", "2", "--steps", "2", "--grid", "2",
              "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "o" / "eval.json").read_text())
    assert report["quality"]["videos"] == 2 and set(report["passed"]) == {"color", "shape", "motion"}
    report = (tmp_path / "o" / "eval.md").read_text()
    assert (tmp_path / "o" / "grid.png").stat().st_size > 0 and "| color |" in report
    # a report of another caption count than the documented figures' says so
    assert report.startswith("2 heldout captions (one video each, noise seed 0, 2 ODE steps") and "1/2" in report


@pytest.mark.slow
def test_eval_tiny_i2v_conditions_on_the_rendered_first_frames(tiny_i2v_dir, tmp_path):
    r = _eval("--i2v", "--centred", "--model_path", str(tiny_i2v_dir), "--num_captions", "2", "--steps", "2",
              "--grid", "0", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "o" / "eval.json").read_text())
    assert report["task"] == "i2v" and report["centred"] and 0 < report["quality"]["first_frame_error"] <= 1
    assert sorted(p.name for p in (tmp_path / "o" / "first_frames").iterdir()) == ["first_frame_000.png",
                                                                                   "first_frame_001.png"]
    assert "| first_frame_error |" in (tmp_path / "o" / "eval.md").read_text()


def _prompt_script():
    """scripts/world_i2v_prompts.py as a module (its main, as `__main__` calls it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("world_i2v_prompts", ROOT / "scripts" / "world_i2v_prompts.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


MOTION_TASK = ["--size", "small", "--centred"]  # configs/world_i2v_motion: the demo's image-to-video motion task


@pytest.mark.parametrize(("folder", "argv"), [
    ("world_i2v/train", ["--captions", "configs/world_prompts.txt"]),
    ("world_i2v/heldout", ["--captions", "configs/world_heldout_prompts.txt"]),
    ("world_i2v_motion/train", ["--grid", "train", "--num", "96", *MOTION_TASK]),
    ("world_i2v_motion/heldout", ["--grid", "heldout", "--num", "16", *MOTION_TASK]),
])
def test_committed_i2v_prompt_folders_are_the_scripts_output(folder, argv, tmp_path, monkeypatch):
    """configs/<folder> is what scripts/world_i2v_prompts.py writes for its command (the script's docstring): the
    same rows (straight motions only; the motion task: small objects, held-out colour-shape pairs in its held-out
    folder, each first frame's object at the centre) and the same pixels."""
    import numpy as np
    import PIL.Image

    monkeypatch.chdir(ROOT)
    script = _prompt_script()
    fresh = script.main([*argv, "--out", str(tmp_path)])
    committed = ROOT / "configs" / folder / "prompts.csv"
    assert fresh.read_text() == committed.read_text()
    from sage_grpo.data import read_prompts

    records = read_prompts(committed)
    assert records and all(parse_caption(r.prompt).motion != "bounces" for r in records)
    for r in records:
        a = np.asarray(PIL.Image.open(r.ref_image_path))
        b = np.asarray(PIL.Image.open(tmp_path / Path(r.ref_image_path).name))
        assert a.shape == (32, 32, 3) and np.array_equal(a, b)
    if "--centred" in argv:
        attrs = [parse_caption(r.prompt) for r in records]
        assert {o.size for a in attrs for o in a.objects} == {"small"}
        assert {a.motion for a in attrs} == {"left", "right", "up", "down"}
        assert all(is_heldout(a) for a in attrs) == folder.endswith("heldout")
        for r in records:  # the object's bounding box (pixels off the corner's background colour) is centred
            frame = np.asarray(PIL.Image.open(r.ref_image_path)).astype(int)
            ys, xs = np.nonzero(np.abs(frame - frame[0, 0]).sum(-1) > 24)
            assert abs((ys.min() + ys.max()) / 2 - 15.5) <= 1 and abs((xs.min() + xs.max()) / 2 - 15.5) <= 1, r


def test_i2v_prompt_script_refuses_what_it_cannot_write(tmp_path):
    from sage_grpo.errors import SageGRPOError

    script = _prompt_script()
    with pytest.raises(SageGRPOError, match="--num needs --grid"):
        script.main(["--captions", str(ROOT / "configs/world_prompts.txt"), "--num", "3", "--out", str(tmp_path)])
    with pytest.raises(SageGRPOError, match="--num 100000: the heldout grid has"):
        script.main(["--grid", "heldout", "--num", "100000", "--out", str(tmp_path)])
