"""generate.py under torchrun: prompts are split across ranks and every video equals the single-process one."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hv_fixtures import *  # noqa: F401,F403

from sage_grpo.video import read_video

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.dist
def test_two_ranks_split_prompts_and_match_one_process(tiny_diffusers_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\na red ball\n")
    common = ["--model_path", str(tiny_diffusers_dir), "--dtype", "fp32", "--video_length", "5", "--fixed_size",
              "16x32", "--num_inference_steps", "3", "--prompt_file", str(prompts)]
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
           str(REPO / "generate.py"), *common, "--output_path", str(tmp_path / "two")]
    proc = subprocess.run(run, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0:" in proc.stdout and "rank 1:" in proc.stdout
    one = subprocess.run([sys.executable, str(REPO / "generate.py"), *common, "--output_path", str(tmp_path / "one")],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "two").glob("*.mp4"))
    assert names == sorted(p.name for p in (tmp_path / "one").glob("*.mp4")) and len(names) == 3
    for name in names:
        assert torch.equal(read_video(tmp_path / "two" / name)[0], read_video(tmp_path / "one" / name)[0])
