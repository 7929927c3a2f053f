#!/usr/bin/env python
"""Benchmark VideoAlign scoring: in-memory batched vs the authors' mp4 round trip, one video at a time.

    python scripts/bench_reward.py                 # builds the tiny checkpoint in a temp dir, CPU
    python scripts/bench_reward.py --reward_model_path ckpts/VideoReward --reward_base_model_path \\
        ckpts/Qwen2-VL-2B-Instruct --device cuda --dtype bf16 --frames 81 --height 352 --width 624

Round trip = for each video: write mp4 (imageio, 24 fps), read it back, score it alone (what the authors' reward
does). In memory = one batched call on the decoded tensors. Prints medians over --repeats and the ratio, and the
largest score difference between the two paths (codec error only), and writes the same JSON report as
scripts/bench_step.py (sage_grpo/benchjson.py) to --json (default $OUT/bench_reward.json when OUT is set, else
outputs/bench/bench_reward.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    """Build/load the reward, time both paths, print a small report."""
    import torch

    from sage_grpo.cli import CLIParser, at_least, quiet_libraries
    from sage_grpo.config import DTYPES, REWARD_MIN_PIXELS, torch_dtype
    from sage_grpo.errors import SageGRPOError
    from sage_grpo.rewards.tiny import write_tiny_base, write_tiny_videoreward
    from sage_grpo.rewards.videoalign import VideoAlignReward
    from sage_grpo.video import read_video, write_video

    ap = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reward_model_path", default="", help="empty = build the tiny checkpoint")
    ap.add_argument("--reward_base_model_path", default="")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=DTYPES)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--frames", type=int, default=33)
    ap.add_argument("--height", type=int, default=64)
    ap.add_argument("--width", type=int, default=96)
    ap.add_argument("--min_pixels", type=int, default=28 * 28 * 4, help="tiny default; the real one is "
                                                                        f"{REWARD_MIN_PIXELS}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="", help="report path (default $OUT/bench_reward.json or outputs/bench/)")
    args = ap.parse_args(argv)
    for flag in ("batch", "frames", "height", "width", "min_pixels", "repeats"):
        at_least(f"--{flag}", getattr(args, flag), 1)
    if bool(args.reward_model_path) != bool(args.reward_base_model_path):
        raise SageGRPOError("give both --reward_model_path and --reward_base_model_path, or neither (tiny model)")
    quiet_libraries()

    tmp = Path(tempfile.mkdtemp(prefix="bench_reward_"))
    if not args.reward_model_path:
        base = write_tiny_base(tmp / "Qwen2-VL-2B-Instruct")
        model = write_tiny_videoreward(tmp / "VideoReward", base)
    else:
        model, base = Path(args.reward_model_path), Path(args.reward_base_model_path)
    reward = VideoAlignReward(model, base, device=args.device, dtype=torch_dtype(args.dtype),
                              min_pixels=args.min_pixels)
    g = torch.Generator().manual_seed(0)
    videos = torch.rand(args.batch, args.frames, 3, args.height, args.width, generator=g).to(args.device)
    prompts = [f"prompt number {i}: a cat playing piano" for i in range(args.batch)]

    def sync() -> None:
        """Wait for the device so timings are honest."""
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize()

    def in_memory() -> dict:
        """One batched call on decoded frames."""
        out = reward(videos, prompts)
        sync()
        return out

    def round_trip() -> dict:
        """Write each video to mp4, read it back, score it alone."""
        outs = []
        for i in range(args.batch):
            p = tmp / f"v{i}.mp4"
            write_video(p, videos[i].cpu(), fps=24)
            frames, _ = read_video(p)
            outs.append(reward(frames.unsqueeze(0).to(args.device), prompts[i : i + 1]))
        sync()
        return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}

    in_memory()  # warm-up (allocator, kernels)
    t_mem, t_rt = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        a = in_memory()
        t_mem.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b = round_trip()
        t_rt.append(time.perf_counter() - t0)
    m_mem, m_rt = statistics.median(t_mem), statistics.median(t_rt)
    diff = max((a[k] - b[k]).abs().max().item() for k in ("VQ", "MQ", "TA"))
    print(f"videos {args.batch} x {args.frames} frames {args.height}x{args.width}, device {args.device}, {args.dtype}")
    print(f"in-memory batched : median {m_mem:.3f} s  ({m_mem / args.batch * 1e3:.1f} ms/video)")
    print(f"mp4 round trip 1x1: median {m_rt:.3f} s  ({m_rt / args.batch * 1e3:.1f} ms/video)")
    print(f"speed-up          : {m_rt / m_mem:.2f}x")
    print(f"max |score diff|  : {diff:.4f} (normalised units; codec error of the mp4 path)")
    from sage_grpo.benchjson import default_json_path, write_report

    results = {
        "videos": args.batch, "frames": args.frames, "height": args.height, "width": args.width, "dtype": args.dtype,
        "tiny_model": not args.reward_model_path, "repeats": args.repeats,
        "seconds_median": {"in_memory": m_mem, "mp4_round_trip": m_rt},
        "seconds": {"in_memory": t_mem, "mp4_round_trip": t_rt},
        "ms_per_video_median": {"in_memory": m_mem / args.batch * 1e3, "mp4_round_trip": m_rt / args.batch * 1e3},
        "max_abs_score_diff": diff,
    }
    notes = ["round trip = write mp4, read back, score one video at a time (the authors' path); in memory = one "
             "batched call on the decoded frames"]
    path = write_report(args.json or default_json_path("bench_reward"), "bench_reward", args.device,
                        {"mp4_round_trip_over_in_memory": m_rt / m_mem}, results, notes)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from sage_grpo.errors import run_cli

    sys.exit(run_cli(main))
