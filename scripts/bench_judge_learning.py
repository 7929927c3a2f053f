#!/usr/bin/env python
"""Training through a VLM judge learns what the judge prefers: GRPO runs of post_train.py on the pretrained tiny
world model with `--reward_model vlm_judge`, the judge a tiny LLaVA served by `transformers serve` whose answer
depends on the frames, and its score on held-out captions before and after, with the same noise.

    python scripts/bench_judge_learning.py                  # 3 seeds, the config's 40 steps
    python scripts/bench_judge_learning.py --quick          # 1 seed, 2 steps, 4 captions x 1 noise: the plumbing

The judge is `sage_grpo.rewards.tiny.write_tiny_frame_judge` (written to --out/judge): its greedy answer is a digit
1..9 that rises with --reads (contrast: how far the frames' patches stand from their frame's mean luma, which for
one object on a plain background grows with the object's area; or brightness: the mean luma), 1 at --lo, 9 at
--hi, whatever the text of the request. It
is served by `transformers serve` on 127.0.0.1 (offline, one thread; its log in --out/serve.log), which returns no
log-probabilities: the judge client parses the answer's digit n as (n - 1) / 9, so a score moves in steps of 1/9.
Every run is post_train.py's own `main` (in this process) with --config (default configs/tiny_world.yaml),
`--reward_model vlm_judge --reward_weights '{"judge":1}' --judge_url <the server>`, --seed 0, 1, ... and
validation off, on the config's training captions.

Evaluation: before training (the base weights, once) and after each run (its last checkpoint), the held-out
captions (the config's valid_video_csv) are sampled by ODE with the config's validation settings, --eval_noises
noise seeds each (validation_seed, +1, ...), the same noise before and after, and scored by the judge through the
server (and by the `brightness` reward, the mean luma, as a check that needs no server). A run's rise is the mean
over those videos of after - before; the table gives each seed's before, after, rise and the rise's paired standard
error over the videos, then the mean rise over the seeds, its standard error over the seeds and their ratio.
Writes --out/summary.json (every video's scores) and --out/table.md; runs/s<seed>/ keeps each run's config.yaml and
metrics.jsonl (its checkpoint is deleted once evaluated). Keep --threads 1 on a shared CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_reward_balance import check_run_args, mean_se  # noqa: E402  (the same runs and statistics)

from sage_grpo.cli import CLIParser, check_writable_dir  # noqa: E402
from sage_grpo.errors import SageGRPOError, run_cli  # noqa: E402

QUICK = {"seeds": 1, "steps": 2, "eval_prompts": 4, "eval_noises": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 seed, 2 steps, 4 evaluation captions, 1 noise each")
    p.add_argument("--seeds", type=int, default=None, help="training seeds 0 .. N-1 (default: 3)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default: the config's max_steps)")
    p.add_argument("--eval_prompts", type=int, default=None,
                   help="evaluation captions: the first N held-out captions (default: all of them)")
    p.add_argument("--eval_noises", type=int, default=None, help="noise seeds per evaluation caption (default: 2)")
    p.add_argument("--reads", choices=("contrast", "brightness"), default="contrast",
                   help="the property the judge's answer rises with (default contrast)")
    p.add_argument("--lo", type=float, default=None, help="the property the judge answers 1 at (default: the "
                   "judge's, sage_grpo.rewards.tiny.FRAME_JUDGE_RANGE)")
    p.add_argument("--hi", type=float, default=None, help="the property the judge answers 9 at (default: the "
                   "judge's)")
    p.add_argument("--config", type=Path, default=Path("configs/tiny_world.yaml"),
                   help="post_train.py config every run starts from (default: configs/tiny_world.yaml)")
    p.add_argument("--out", type=Path, default=Path("outputs/judge_learning"), help="output directory")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (post_train's --threads; default 1)")
    p.add_argument("--train_args", default="", help="extra post_train.py flags for every run, space-separated")
    args = check_run_args(p.parse_args(argv), QUICK)
    from sage_grpo.rewards.tiny import FRAME_JUDGE_RANGE

    args.lo = FRAME_JUDGE_RANGE[args.reads][0] if args.lo is None else args.lo
    args.hi = FRAME_JUDGE_RANGE[args.reads][1] if args.hi is None else args.hi
    if not 0 <= args.lo < args.hi <= 1:
        raise SageGRPOError(f"need 0 <= --lo < --hi <= 1, got {args.lo} and {args.hi}")
    return args


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model: Path, log: Path, timeout: float = 180.0):
    """`transformers serve MODEL` on 127.0.0.1 in its own process (offline, one thread, output in ``log``) ->
    (its URL, the process); killed by its pid on exit."""
    import httpx

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    exe = Path(sys.executable).with_name("transformers")
    with open(log, "w") as out:
        proc = subprocess.Popen([str(exe), "serve", str(model), "--device", "cpu", "--host", "127.0.0.1", "--port",
                                 str(port)], env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise SageGRPOError(f"transformers serve exited ({proc.returncode}): {log.read_text()[-1500:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SageGRPOError(f"transformers serve did not answer within {timeout:.0f} s (log: {log})")
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.kill()
        proc.wait()


def chat_requests(log: Path) -> int:
    """The chat completions the server's log shows answered (uvicorn's access lines)."""
    return log.read_text().count('"POST /v1/chat/completions HTTP/1.1" 200')


def paired(before: list[float], after: list[float]) -> dict:
    """The rise after - before over paired scores (the same caption and noise): its mean, standard error and their
    ratio."""
    d = mean_se([a - b for a, b in zip(after, before, strict=True)])
    return {**d, "std_errors": d["mean"] / d["se"] if d["se"] > 0 else math.nan}


def aggregate(base: dict[str, list[float]], runs: list[dict]) -> dict:
    """base: {component: [score per video]}; runs: {"seed", "scores": {component: [score per video]}} -> per
    component: each seed's before / after means and paired rise, the rise over the seeds (`mean_se` of the seeds'
    rises and its ratio: what varies from run to run) and the paired rise pooled over all seeds' videos (each
    video's after - before, the same caption and noise, every seed's)."""
    table = {}
    for k in base:
        per_seed = {r["seed"]: {"before": statistics.fmean(base[k]), "after": statistics.fmean(r["scores"][k]),
                                "rise": paired(base[k], r["scores"][k])} for r in runs}
        over = mean_se([s["rise"]["mean"] for s in per_seed.values()])
        pooled = paired(base[k] * len(runs), [x for r in runs for x in r["scores"][k]])
        table[k] = {"per_seed": per_seed, "pooled": pooled,
                    "rise": {**over, "std_errors": over["mean"] / over["se"] if over["se"] > 0 else math.nan}}
    return table


def format_table(table: dict) -> str:
    """The aggregate as a markdown table: one row per seed and component, then the mean over the seeds."""
    lines = ["| seed | component | before | after | rise (paired SE over videos) |", "|---|---|---|---|---|"]
    comps = list(table)
    for seed in table[comps[0]]["per_seed"]:
        for k in comps:
            s = table[k]["per_seed"][seed]
            r = s["rise"]
            lines.append(f"| {seed} | {k} | {s['before']:.4f} | {s['after']:.4f} | {r['mean']:+.4f} "
                         f"({r['se']:.4f}, {r['std_errors']:+.1f} SE) |")
    for k in comps:
        r, q = table[k]["rise"], table[k]["pooled"]
        lines.append(f"| mean of {r['n']} | {k} | | | **{r['mean']:+.4f}**: paired SE over the {q['n']} videos "
                     f"{q['se']:.4f} (**{q['std_errors']:+.1f} SE**); SE over the seeds {r['se']:.4f} "
                     f"({r['std_errors']:+.2f} SE) |")
    return "\n".join(lines)


def run_argv(args, run_dir: Path, url: str, seed: int) -> list[str]:
    """post_train.py's flags for one run."""
    argv = ["--config", str(args.config), "--output_dir", str(run_dir), "--reward_model", "vlm_judge",
            "--reward_weights", '{"judge":1.0}', "--judge_url", url, "--seed", str(seed), "--validation_interval",
            "0", "--validate_at_step0", "False", "--save_interval", "0", "--resume_from_checkpoint", "",
            "--overwrite_output_dir", "True", "--report_to", "none", "--threads", str(args.threads)]
    argv += ["--max_steps", str(args.steps)] if args.steps is not None else []
    return argv + args.train_args.split()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if not args.config.is_file():
        raise SageGRPOError(f"--config {str(args.config)!r} is not a file")
    out: Path = check_writable_dir(args.out, "--out")

    import torch
    from bench_reward_balance import Evaluator

    import post_train
    from sage_grpo.checkpoint import list_checkpoints
    from sage_grpo.cli import quiet_libraries
    from sage_grpo.config import load_config
    from sage_grpo.data import read_prompts
    from sage_grpo.rewards.tiny import write_tiny_frame_judge

    quiet_libraries()
    torch.set_num_threads(args.threads)
    judge_dir = write_tiny_frame_judge(out / "judge", reads=args.reads, lo=args.lo, hi=args.hi)
    log = out / "serve.log"
    with serve(judge_dir, log) as (url, _):
        cfg = load_config(["--config", str(args.config), "--reward_model", "vlm_judge,brightness", "--reward_weights",
                           '{"judge":1.0,"brightness":1.0}', "--judge_url", url])
        steps = args.steps if args.steps is not None else cfg.optim.max_steps
        records = read_prompts(cfg.validation.valid_video_csv)[: args.eval_prompts]
        ev = Evaluator(cfg, records, args.eval_noises)
        base = ev.scores()
        n_videos = len(base["judge"])
        print(f"[judge_learning] {args.seeds} seeds x {steps} steps, judge: {args.reads} {args.lo} -> 1 .. {args.hi} "
              f"-> 9 at {url}; evaluation {len(records)} held-out captions x {args.eval_noises} noises; base judge "
              f"{statistics.fmean(base['judge']):.4f} (digits " + " ".join(str(round(s * 9 + 1)) for s in base["judge"])
              + f"), brightness {statistics.fmean(base['brightness']):.4f} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        runs = []
        for seed in range(args.seeds):
            w0 = time.perf_counter()
            run_dir = out / "runs" / f"s{seed}"
            requests = chat_requests(log)
            post_train.main(run_argv(args, run_dir, url, seed))
            train_requests = chat_requests(log) - requests
            ckpts = list_checkpoints(run_dir)
            if not ckpts or ckpts[-1][0] != steps:
                raise SageGRPOError(f"{run_dir.name} stopped at step {ckpts[-1][0] if ckpts else 0} of {steps} (a "
                                    "stop signal?): the measurement stops")
            w1 = time.perf_counter()
            scores = ev.trained(ckpts[-1][1])
            for _, path in ckpts:
                shutil.rmtree(path)  # tens of MB each; the scores and the run's config and metrics stay
            run = {"seed": seed, "scores": scores, "train_requests": train_requests, "train_s": w1 - w0,
                   "eval_s": time.perf_counter() - w1}
            runs.append(run)
            print(f"[judge_learning] s{seed}: judge {statistics.fmean(base['judge']):.4f} -> "
                  f"{statistics.fmean(scores['judge']):.4f} (digits " + " ".join(str(round(s * 9 + 1))
                                                                               for s in scores["judge"])
                  + f"), brightness {statistics.fmean(base['brightness']):.4f} -> "
                    f"{statistics.fmean(scores['brightness']):.4f}; {train_requests} judge requests, "
                    f"{run['train_s']:.0f} s training, {run['eval_s']:.0f} s evaluation; total "
                    f"{time.perf_counter() - t0:.0f} s", flush=True)
        total_requests = chat_requests(log)
    table = aggregate(base, runs)
    text = format_table(table)
    (out / "table.md").write_text(text + "\n")
    summary = {"steps": steps, "seeds": list(range(args.seeds)), "reads": args.reads, "lo": args.lo, "hi": args.hi,
               "eval_captions": [r.prompt for r in records], "eval_noise_seeds": ev.seeds, "videos": n_videos,
               "base_scores": base, "runs": runs, "table": table, "judge_requests": total_requests,
               "total_s": time.perf_counter() - t0}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nThe judge's score (parsed digit n as (n - 1) / 9) and the mean luma on {len(records)} held-out "
          f"captions x {args.eval_noises} noises (ODE, the same noise before and after), {steps} GRPO steps per run:")
    print(text)
    print(f"[judge_learning] {total_requests} judge requests; total {time.perf_counter() - t0:.0f} s -> {out}")
    return summary


if __name__ == "__main__":
    run_cli(main)
