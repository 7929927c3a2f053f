"""Quality measures of a world model (sage_grpo.world.evaluate) and scripts/eval_tiny.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from world_fixtures import blur

from sage_grpo.world import parse_caption, render_caption
from sage_grpo.world.evaluate import eval_captions, quality, sharpness
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


def _eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "eval_tiny.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def test_eval_tiny_missing_model_file_is_one_line(tiny_diffusers_dir, tmp_path):
    broken = tmp_path / "model"
    shutil.copytree(tiny_diffusers_dir, broken)
    (broken / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    r = _eval("--model_path", str(broken), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "transformer" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 3  # the message and its list
    r = _eval("--model_path", str(tiny_diffusers_dir), "--num_captions", "100000", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "one-object captions" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_eval_tiny_writes_its_report(tiny_diffusers_dir, tmp_path):
    r = _eval("--model_path", str(tiny_diffusers_dir), "--num_captions", "2", "--steps", "2", "--grid", "2",
              "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "o" / "eval.json").read_text())
    assert report["quality"]["videos"] == 2 and set(report["passed"]) == {"color", "shape", "motion"}
    assert (tmp_path / "o" / "grid.png").stat().st_size > 0 and "| color |" in (tmp_path / "o" / "eval.md").read_text()
