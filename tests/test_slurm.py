"""run_post_train_slurm.sh under a real one-node SLURM (slurmctld, slurmd and munge started by
scripts/slurm_cluster.sh, stopped after): the early-warning signal makes the job save and requeue itself, the requeued
allocation continues the run exactly, `scancel --signal=TERM` stops it for good with a checkpoint, and a new job with
fewer processes per node (a resubmission after losing GPUs) continues that checkpoint to the end.

The early warning is sent by hand (`scancel --batch --signal=USR1`, what slurmctld sends at `--signal=B:USR1@T`) as
soon as the run has trained 2 steps: SLURM's own timer fires up to 60 s late, which a test cannot wait for. Requeue is
SLURM's, with the cluster's 5-second credential expiry (scripts/slurm_cluster.sh says why)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import free_port
from post_train_helpers import checkpoint_weights

from sage_grpo.checkpoint import list_checkpoints
from sage_grpo.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.dist]
STEPS = 8  # the whole run; the two stops land near steps 2 and 4


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The environment sbatch and scontrol need to reach a one-node cluster of this machine."""
    d = tmp_path_factory.mktemp("slurm")
    r = subprocess.run(["bash", str(ROOT / "scripts/slurm_cluster.sh"), "start", str(d)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    keep = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in (
        "AUTO_RESUME", "MAX_RESTARTS", "NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT")}
    try:
        yield {**keep, "SLURM_CONF": str(d / "slurm.conf"), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
               "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "CONFIG": "configs/tiny_cpu.yaml"}
    finally:
        subprocess.run(["bash", str(ROOT / "scripts/slurm_cluster.sh"), "stop", str(d)], timeout=60)


def _args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["--model_path", str(model), "--output_dir", str(out), "--batch_size", "2", "--grpo_sampling_steps", "4",
            "--sample_n_frames", "5", "--report_to", "none", "--log_interval", "1", "--max_steps", str(STEPS),
            "--save_interval", "0", *extra]


def _sbatch(env: dict, log: Path, nproc: int, args: list[str]) -> str:
    r = subprocess.run(["sbatch", "--parsable", "--nodes", "1", "--gpus-per-node=0", "--output", str(log),
                        "run_post_train_slurm.sh", *args], cwd=ROOT,
                       env={**env, "NPROC_PER_NODE": str(nproc), "MASTER_PORT": str(free_port())},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _job(env: dict, job: str) -> dict[str, str]:
    """scontrol's fields of a job (JobState, Restarts, ExitCode, ...)."""
    text = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", text))


def _wait(what, until, log: Path, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s:\n" + (
            log.read_text()[-3000:] if log.exists() else "(no job output)")
        time.sleep(0.5)


def _steps(out: Path) -> list[int]:
    m = out / "metrics.jsonl"
    return [r["step"] for r in read_metrics(m)] if m.exists() else []


def test_a_requeued_job_continues_exactly_and_a_job_with_fewer_processes_finishes_it(slurm, tmp_path):
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "hv")
    straight, run = tmp_path / "straight", tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "post_train.py", "--config", "configs/tiny_cpu.yaml",
                        *_args(model, straight, "--save_interval", "1")],
                       cwd=ROOT, env=slurm, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    # job 1, 2 processes: USR1 (the limit nears) -> checkpoint, requeue; then a plain stop -> checkpoint, no requeue
    log = tmp_path / "job1.out"
    job = _sbatch(slurm, log, 2, _args(model, run))
    _wait("step 2", lambda: len(_steps(run)) >= 2, log)
    assert subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm).returncode == 0
    _wait("the requeued allocation's step", lambda: "resumed from" in log.read_text() and len(_steps(run)) >= 4, log)
    first = list_checkpoints(run)[0][0]
    assert subprocess.run(["scancel", "--signal=TERM", job], env=slurm).returncode == 0
    _wait("the job's end", lambda: _job(slurm, job).get("JobState") not in ("RUNNING", "PENDING", "COMPLETING"), log)
    text, state = log.read_text(), _job(slurm, job)
    assert (state["JobState"], state["Restarts"], state["ExitCode"]) == ("COMPLETED", "1", "0:0"), text[-3000:]
    [(a, _), (b, stopped)] = list_checkpoints(run)
    assert a == first and 2 <= a < b < STEPS, text[-3000:]
    assert f"stopped by SIGTERM after step {a}; checkpoint-{a} is saved" in text
    assert f"resumed from {run / f'checkpoint-{a}'} at step {a}" in text
    assert f"stopped by SIGTERM after step {b}; checkpoint-{b} is saved" in text and "Traceback" not in text
    assert _steps(run) == list(range(1, b + 1))
    at_b = checkpoint_weights(straight / f"checkpoint-{b}")
    got = checkpoint_weights(stopped)
    assert all(torch.equal(got[k], at_b[k]) for k in at_b), "the requeued run left the uninterrupted one"

    # job 2, 1 process per node with the same 4 videos per step: continues checkpoint-b for one step
    log = tmp_path / "job2.out"
    job = _sbatch(slurm, log, 1, _args(model, run, "--batch_size", "4", "--max_steps", str(b + 1)))
    _wait("the job's end", lambda: _job(slurm, job).get("JobState") not in ("RUNNING", "PENDING", "COMPLETING"), log)
    text, state = log.read_text(), _job(slurm, job)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text[-3000:]
    assert (f"checkpoint-{b} was written on another layout: world size 2 -> 1, batch_size per rank 2 -> 4 "
            "(data-parallel ranks 2 -> 1); the same 4 videos (1 prompts) per step") in text, text[-3000:]
    assert _steps(run) == list(range(1, b + 2))
    want = checkpoint_weights(straight / f"checkpoint-{b + 1}")
    got = checkpoint_weights(list_checkpoints(run)[-1][1])
    moved = max(float((want[k] - at_b[k]).abs().max()) for k in want)
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    print(f"continued on 1 process: weights within {diff:.2e} of the uninterrupted run (step {b + 1} moved them "
          f"{moved:.2e})")
    assert diff < 1e-4 < moved  # Muon's bf16 Newton-Schulz: see the tolerance in test_resume_layouts.py
