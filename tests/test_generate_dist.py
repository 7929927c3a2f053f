"""generate.py under torchrun: prompts are split over data-parallel groups and every video equals the single-process
one, with plain data parallelism (2 ranks) and with Ulysses sequence parallelism (one sp group of 2 ranks)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sage_grpo.video import read_video

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tiny_diffusers_dir, tmp_path_factory):
    """The common flags and the videos of one process (the reference: generate.main in this process; generate.py as
    a script is tests/test_generate.py's, under torchrun the tests' below)."""
    import generate

    tmp = tmp_path_factory.mktemp("gen_dist")
    prompts = tmp / "p.txt"
    prompts.write_text("a cat\na dog\na red ball\n")
    common = ["--model_path", str(tiny_diffusers_dir), "--dtype", "fp32", "--video_length", "5", "--fixed_size",
              "16x32", "--num_inference_steps", "3", "--prompt_file", str(prompts)]
    assert len(generate.main([*common, "--output_path", str(tmp / "one")])) == 3
    return common, tmp / "one", tmp


@pytest.fixture(scope="module")
def launch(setup):
    """generate.py twice in one torchrun launch on 2 gloo ranks (tests/dist_workers/run_workers.py): plain data
    parallelism into `two/`, then one sp group of 2 ranks (--sp_size 2) into `sp/` -> {run: its stdout}."""
    import json

    common, _, tmp = setup
    runs = {"two": [], "sp": ["--sp_size", "2"]}
    spec = tmp / "workers.json"
    spec.write_text(json.dumps([[str(REPO / "generate.py"), *common, "--output_path", str(tmp / name), *extra]
                                for name, extra in runs.items()]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(REPO / "tests/dist_workers/run_workers.py"), str(spec)],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = [part for part in proc.stdout.split("== worker ") if part.strip()]
    return {name: "".join(p.split("\n", 1)[1] for p in outs if p.startswith(f"{i}\n")) for i, name in enumerate(runs)}


def _videos(folder):
    return {p.name: read_video(p)[0] for p in sorted(Path(folder).glob("*.mp4"))}


@pytest.mark.dist
def test_two_ranks_split_prompts_and_match_one_process(setup, launch):
    common, one, tmp = setup
    out = launch["two"]
    assert "rank 0:" in out and "rank 1:" in out  # each rank wrote its share
    two, ref = _videos(tmp / "two"), _videos(one)
    assert sorted(two) == sorted(ref) and len(ref) == 3
    for name in ref:
        assert torch.equal(two[name], ref[name])


@pytest.mark.dist
def test_sequence_parallel_pair_writes_the_single_process_videos(setup, launch):
    """--sp_size 2 on 2 ranks: one sp group samples all 3 prompts together; only its rank 0 writes. The transformer
    output equals one process to fp32 rounding (tests/test_ulysses.py); after the uint8/H.264 round trip the frames
    differ by at most 1 level in a few pixels."""
    common, one, tmp = setup
    out = launch["sp"]
    assert out.count("rank 0:") == 3 and "rank 1:" not in out
    sp, ref = _videos(tmp / "sp"), _videos(one)
    assert sorted(sp) == sorted(ref) and len(ref) == 3
    for name in ref:
        diff = (sp[name] - ref[name]).abs() * 255  # frames are in [0, 1]: uint8 levels
        assert diff.max() <= 1 and diff.mean() < 0.01, (name, float(diff.max()), float(diff.mean()))
