#!/usr/bin/env python
"""Benchmark overlapped scoring (--reward_overlap, docs/rewards.md "Overlap"): rollout + reward time per step, in
order against overlapped, with a remote reward server or a local reward that works on the CPU.

    python scripts/bench_reward_overlap.py                      # tiny random model on the CPU, 0.12 s a video
    python scripts/bench_reward_overlap.py --seconds_per_video 0.5 --steps 5
    python scripts/bench_reward_overlap.py --reward local --steps 5            # matmuls on the CPU, in a thread
    python scripts/bench_reward_overlap.py --reward local --local_work python  # a pure-Python loop (holds the GIL)

--reward remote starts scripts/serve_reward.py in its own process with the `brightness` reward made slow on purpose
(a sleep of --seconds_per_video per video, so scoring costs what a real reward model would). --reward local trains
with a local reward instead (`brightness` plus real work on the CPU, `runs_on_cpu = True`, so the trainer scores it
in its worker thread): --local_work matmul does 256 x 256 float matmuls (torch, which releases the GIL as a CPU
reward model's forward does), python a pure-Python loop (which holds the GIL, as Python-heavy detectors do); the
number of either per video is calibrated here to take --seconds_per_video alone. Then runs post_train.py's own
`main` (in this process) on the tiny random model (configs/tiny_cpu.yaml: --batch_size videos a step, sampled
and scored in chunks of --chunk) four times, with --reward_overlap false, true, true, false (so that a machine whose
load drifts favours neither), and reads `perf/rollout_s` + `perf/reward_s` of steps 2.. from each run's
metrics.jsonl (step 1 pays the warm-up). Prints the medians over both runs of each, their ratio, each phase's median
and the scoring time alone, and writes the JSON report of sage_grpo/benchjson.py to --json (default
$OUT/bench_reward_overlap.json when OUT is set, else outputs/bench/bench_reward_overlap.json).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.cli import CLIParser, at_least  # noqa: E402
from sage_grpo.errors import SageGRPOError, run_cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The served reward: brightness after a sleep per video (the server imports this file as `<file>:build`).
SLOW_REWARD = """
import os, time
from sage_grpo.rewards.builtin import BrightnessReward
class Slow(BrightnessReward):
    def __call__(self, videos, prompts):
        time.sleep(float(os.environ["SLOW_REWARD_S_PER_VIDEO"]) * len(prompts))
        return super().__call__(videos, prompts)
def build(**kw):
    return Slow()
"""
# The local reward: brightness after BUSY_UNITS_PER_VIDEO units of BUSY_WORK per video ("matmul" or "python").
BUSY_REWARD = """
import os, torch
from sage_grpo.rewards.builtin import BrightnessReward
def work(kind, units):
    if kind == "matmul":
        a, x = torch.full((256, 256), 1 / 256), torch.ones(256, 256)
        for _ in range(units):
            x = x @ a
    else:
        total = 0
        for i in range(units * 10000):
            total += i * i
class Busy(BrightnessReward):
    runs_on_cpu = True  # its work is on the CPU: overlapped, the trainer scores it in its worker thread
    def __call__(self, videos, prompts):
        work(os.environ["BUSY_WORK"], int(os.environ["BUSY_UNITS_PER_VIDEO"]) * len(prompts))
        return super().__call__(videos, prompts)
def build(**kw):
    return Busy()
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reward", choices=("remote", "local"), default="remote",
                   help="a remote reward server that sleeps, or a local reward that works on the CPU")
    p.add_argument("--local_work", choices=("matmul", "python"), default="matmul",
                   help="--reward local: torch matmuls (release the GIL) or a pure-Python loop (holds it)")
    p.add_argument("--seconds_per_video", type=float, default=0.12, help="scoring time per video")
    p.add_argument("--steps", type=int, default=3, help="training steps per run (the median is over steps 2..)")
    p.add_argument("--batch_size", type=int, default=8, help="videos a step")
    p.add_argument("--chunk", type=int, default=2, help="videos per chunk (--mini_batch_size_per_update)")
    p.add_argument("--sampling_steps", type=int, default=8, help="--grpo_sampling_steps of the rollout")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer and the server")
    p.add_argument("--json", default="", help="report path (default $OUT/bench_reward_overlap.json or outputs/bench/)")
    a = p.parse_args(argv)
    at_least("--steps", a.steps, 2)
    at_least("--chunk", a.chunk, 1)
    at_least("--seconds_per_video", a.seconds_per_video, 0)
    if a.batch_size <= a.chunk or a.batch_size % a.chunk:
        raise SageGRPOError(f"--batch_size {a.batch_size} must be a multiple of --chunk {a.chunk} and larger: "
                            "overlap needs at least two chunks")
    return a


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SageGRPOError(f"the reward server exited: {proc.stdout.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SageGRPOError(f"the reward server did not answer {url}/health within {timeout:.0f} s")
        time.sleep(0.1)


def _units_per_video(plugin: Path, kind: str, seconds: float) -> int:
    """Units of the local reward's work that take `seconds` here (the median of 3 timings of 20 units)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("busy_reward_calibration", plugin)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        module.work(kind, 20)
        times.append((time.perf_counter() - t0) / 20)
    return max(1, round(seconds / statistics.median(times)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from sage_grpo.benchjson import default_json_path, write_report
    from sage_grpo.metrics import read_metrics
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    sys.path.insert(0, str(ROOT))
    import post_train

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = write_tiny_checkpoint(tmp / "tiny" / "hv")
        plugin = tmp / "reward.py"
        proc, units = None, 0
        if args.reward == "remote":
            plugin.write_text(SLOW_REWARD)
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads),
                   "SLOW_REWARD_S_PER_VIDEO": str(args.seconds_per_video)}
            env.pop("SAGE_REWARD_TOKEN", None)
            proc = subprocess.Popen([sys.executable, str(ROOT / "scripts/serve_reward.py"), "--port", str(port),
                                     "--device", "cpu", "--reward_model", f"{plugin}:build"], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            reward = ["--reward_model", "remote", "--reward_url", url]
        else:
            plugin.write_text(BUSY_REWARD)
            units = _units_per_video(plugin, args.local_work, args.seconds_per_video)
            os.environ.update(BUSY_WORK=args.local_work, BUSY_UNITS_PER_VIDEO=str(units))
            reward = ["--reward_model", f"{plugin}:build", "--reward_weights", '{"brightness":1.0}']
        per_step: dict[str, list[float]] = {"false": [], "true": []}
        phases: dict[str, dict[str, list[float]]] = {o: {"rollout": [], "reward": []} for o in per_step}
        try:
            if proc is not None:
                _wait_healthy(url, proc)
            for i, overlap in enumerate(("false", "true", "true", "false")):
                out = tmp / f"run{i}_overlap_{overlap}"
                post_train.main([
                    "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--model_path", str(model),
                    "--output_dir", str(out), "--train_video_csv", str(ROOT / "configs/tiny_prompts.txt"),
                    "--sample_n_frames", "5", "--save_interval", "0", "--report_to", "none", *reward,
                    "--batch_size", str(args.batch_size), "--mini_batch_size_per_update", str(args.chunk),
                    "--grpo_sampling_steps", str(args.sampling_steps), "--max_steps", str(args.steps),
                    "--reward_overlap", overlap])
                rows = read_metrics(out / "metrics.jsonl")[1:]  # step 1 pays the warm-up
                per_step[overlap] += [r["perf/rollout_s"] + r["perf/reward_s"] for r in rows]
                for phase in ("rollout", "reward"):
                    phases[overlap][phase] += [r[f"perf/{phase}_s"] for r in rows]
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
    serial, overlapped = statistics.median(per_step["false"]), statistics.median(per_step["true"])
    scoring = args.seconds_per_video * args.batch_size
    what = "remote (sleep)" if args.reward == "remote" else f"local ({args.local_work}, {units} units a video)"
    med = {o: {k: statistics.median(v) for k, v in ph.items()} for o, ph in phases.items()}
    print(f"{what}: rollout + reward per step (median of steps 2-{args.steps} of two runs each): in order "
          f"{serial:.2f} s (rollout {med['false']['rollout']:.2f} + reward {med['false']['reward']:.2f}), overlapped "
          f"{overlapped:.2f} s (rollout {med['true']['rollout']:.2f} + wait {med['true']['reward']:.2f}), ratio "
          f"{overlapped / serial:.2f}; scoring alone {scoring:.2f} s a step")
    path = write_report(args.json or default_json_path("bench_reward_overlap"), "bench_reward_overlap", "cpu",
                        {"overlapped_over_in_order": overlapped / serial},
                        {"in_order_s": serial, "overlapped_s": overlapped, "scoring_alone_s": scoring,
                         "phase_medians_s": med, "units_per_video": units, "per_step_s": per_step,
                         "settings": vars(args)})
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
