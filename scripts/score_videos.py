#!/usr/bin/env python
"""Score mp4 videos with any set of rewards/metrics: the evaluation table of the paper (Table 2).

    # a folder of mp4s; each video's prompt is read from <name>.txt beside it (else the file name is used)
    python scripts/score_videos.py --videos outputs/samples/step_000100 --out eval/step100 \\
        --metrics videoalign_local,clipscore,pickscore --pretrained_model_root ckpts
    # a CSV with a `prompt` column and a `video_path` (or `video`, `path`) column
    python scripts/score_videos.py --videos eval_prompts.csv --out eval/base

Writes <out>.csv (one row per video + a final "MEAN" row) and <out>.json ({"videos": [...], "means": {...},
"n_failed": {...}}). Columns: VQ, MQ, TA, Overall (normalised VideoAlign), CLIPScore, PickScore and any other
component of the chosen metrics. Failed scores are NaN and left out of the means (their count is reported).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.config import DTYPES  # noqa: E402
from sage_grpo.errors import SageGRPOError  # noqa: E402

VIDEO_COLUMNS = ("video_path", "video", "path")


def list_inputs(src: Path) -> list[tuple[Path, str]]:
    """(video path, prompt) pairs from a folder of mp4s or a prompt CSV."""
    if not src.exists():
        raise SageGRPOError(
            f"--videos {src} does not exist: give a folder of .mp4 files or a CSV with prompt + video_path"
        )
    if src.is_dir():
        vids = sorted(src.glob("*.mp4"))
        if not vids:
            raise SageGRPOError(f"no .mp4 files in {src}")
        pairs = []
        for v in vids:
            txt = v.with_suffix(".txt")
            prompt = txt.read_text().strip() if txt.is_file() else v.stem.replace("_", " ")
            pairs.append((v, prompt))
        return pairs
    try:
        with src.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except (UnicodeDecodeError, csv.Error) as err:
        raise SageGRPOError(f"cannot read {src} as CSV: {err}") from None
    cols = set(rows[0]) if rows else set()
    vcol = next((c for c in VIDEO_COLUMNS if c in cols), None)
    if "prompt" not in cols or vcol is None:
        raise SageGRPOError(
            f"{src} needs a 'prompt' column and one of {', '.join(VIDEO_COLUMNS)}; found columns {sorted(cols)}"
        )
    pairs = []
    for i, r in enumerate(rows):
        p = Path(r[vcol])
        p = p if p.is_absolute() else src.parent / p
        if not p.is_file():
            raise SageGRPOError(f"{src} row {i + 2}: video {p} does not exist")
        pairs.append((p, r["prompt"]))
    return pairs


def build_metrics(args: argparse.Namespace) -> dict:
    """name -> Reward for every requested metric (errors name the flag to fix)."""
    from sage_grpo.rewards import get_reward_builder

    kwargs = dict(
        reward_model_path=args.reward_model_path,
        reward_base_model_path=args.reward_base_model_path,
        reward_checkpoint_mode=args.reward_checkpoint_mode,
        pretrained_model_root=args.pretrained_model_root,
        device=args.device,
        dtype=args.dtype,
        max_pixels=args.max_pixels,
        sample_fps=args.sample_fps,
        video_fps=args.video_fps,
        clip_model_path=args.clip_model_path,
        pickscore_model_path=args.pickscore_model_path,
        pickscore_processor_path=args.pickscore_processor_path,
    )
    if args.min_pixels:
        kwargs["min_pixels"] = args.min_pixels
    names = [n.strip() for n in args.metrics.split(",") if n.strip()]
    if not names:
        raise SageGRPOError("--metrics is empty")
    return {n: get_reward_builder(n)(**kwargs) for n in names}


def score_all(pairs: list[tuple[Path, str]], metrics: dict, device: str, video_fps: float) -> list[dict]:
    """One row per video: file, prompt and every metric component (NaN where decoding or scoring failed)."""
    import torch

    from sage_grpo.rewards.base import score_safely
    from sage_grpo.rewards.video_io import read_mp4

    comps = [c for m in metrics.values() for c in m.components]
    rows = []
    for path, prompt in pairs:
        row = {"video": str(path), "prompt": prompt}
        try:
            frames, fps = read_mp4(path)
        except SageGRPOError as err:
            warnings.warn(str(err), RuntimeWarning, stacklevel=1)
            rows.append({**row, **{c: math.nan for c in comps}})
            continue
        if abs(fps - video_fps) > 0.5:
            warnings.warn(f"{path} is {fps:g} fps but frames are sampled assuming --video_fps {video_fps:g}",
                          RuntimeWarning, stacklevel=1)  # fmt: skip
        video = frames.unsqueeze(0).to(device)  # [1, F, 3, H, W]
        for m in metrics.values():
            with torch.no_grad():
                out = score_safely(m, video, [prompt])
            row.update({c: float(out[c][0]) for c in m.components})
        rows.append(row)
    return rows


def summarise(rows: list[dict]) -> tuple[dict, dict]:
    """(means over finite values, NaN counts) of every numeric column."""
    cols = [k for k in rows[0] if k not in ("video", "prompt")]
    means, failed = {}, {}
    for c in cols:
        vals = [r[c] for r in rows if not math.isnan(r[c])]
        means[c] = sum(vals) / len(vals) if vals else math.nan
        failed[c] = len(rows) - len(vals)
    return means, failed


def write_tables(rows: list[dict], out: Path) -> None:
    """<out>.csv with a final MEAN row, and <out>.json with rows, means and failure counts."""
    means, failed = summarise(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = list(rows[0])
    with out.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
        w.writerow({"video": "MEAN", "prompt": "", **means})
    clean = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]
    js = {"videos": clean, "means": {k: (None if math.isnan(v) else v) for k, v in means.items()}, "n_failed": failed}
    out.with_suffix(".json").write_text(json.dumps(js, indent=2))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags (reward flags share the training flags' names)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--videos", required=True, help="folder of .mp4 files, or CSV with prompt + video_path columns")
    ap.add_argument("--out", required=True, help="output prefix: writes <out>.csv and <out>.json")
    ap.add_argument("--metrics", default="videoalign_local,clipscore,pickscore", help="comma-separated reward names")
    ap.add_argument("--pretrained_model_root", default="ckpts")
    ap.add_argument("--reward_model_path", default="", help="default <root>/VideoReward")
    ap.add_argument("--reward_base_model_path", default="", help="default <root>/Qwen2-VL-2B-Instruct")
    ap.add_argument("--reward_checkpoint_mode", default="v3", choices=("v1", "v2", "v3"))
    ap.add_argument("--clip_model_path", default="", help="default <root>/clip-vit-large-patch14")
    ap.add_argument("--pickscore_model_path", default="", help="default <root>/PickScore_v1")
    ap.add_argument("--pickscore_processor_path", default="", help="default <root>/CLIP-ViT-H-14-laion2B-s32B-b79K")
    ap.add_argument("--device", default="cuda" if _cuda() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=DTYPES)
    ap.add_argument("--max_pixels", type=int, default=200704)
    ap.add_argument("--min_pixels", type=int, default=0, help="0 = VideoAlign's default (100352)")
    ap.add_argument("--sample_fps", type=float, default=2.0)
    ap.add_argument("--video_fps", type=float, default=24.0)
    return ap.parse_args(argv)


def _cuda() -> bool:
    """Whether CUDA is usable (imported lazily so --help stays fast)."""
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    """Run; user errors print one line to stderr and return 2."""
    args = parse_args(argv)
    try:
        pairs = list_inputs(Path(args.videos))
        metrics = build_metrics(args)
        rows = score_all(pairs, metrics, args.device, args.video_fps)
        write_tables(rows, Path(args.out))
    except SageGRPOError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    means, failed = summarise(rows)
    print(f"scored {len(rows)} videos -> {Path(args.out).with_suffix('.csv')}, {Path(args.out).with_suffix('.json')}")
    for k, v in means.items():
        print(f"  {k:>12s}: {v: .4f}" + (f"  ({failed[k]} failed)" if failed[k] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
