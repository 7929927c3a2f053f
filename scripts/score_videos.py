#!/usr/bin/env python
"""Score mp4 videos with any set of rewards/metrics: the evaluation table of the paper (Table 2).

    # a folder of mp4s (generate.py's output): each prompt is read exactly from <name>.txt beside its video
    # (else taken from the file name, with a warning); --videos may also be one .mp4
    python scripts/score_videos.py --videos outputs/samples/step_000100 --out eval/step100 \\
        --metrics videoalign_local,clipscore,pickscore --pretrained_model_root ckpts
    # a CSV with a `prompt` column and a `video_path` (or `video`, `path`) column
    python scripts/score_videos.py --videos eval_prompts.csv --out eval/base
    # a VLM judge behind an OpenAI-compatible chat server (--judge_*, --reward_timeout, --reward_retries as in
    # training)
    python scripts/score_videos.py --videos outputs/samples/step_000100 --out eval/judge100 \\
        --metrics vlm_judge --judge_url http://judgehost:8001

Writes <out>.csv (one row per video + a final "MEAN" row) and <out>.json ({"videos": [...], "means": {...},
"n_failed": {...}}). Columns: VQ, MQ, TA, Overall (normalised VideoAlign), CLIPScore, PickScore and any other
component of the chosen metrics. A video that fails is one warning line and NaN, left out of the means (their
count is reported); when a column has no score at all the tables are still written and the exit code is 2. Every
flag is checked, and the output is proven writable, before any model loads.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.cli import CLIParser, at_least, check_output_file, quiet_libraries  # noqa: E402
from sage_grpo.config import (  # noqa: E402
    DTYPES,
    REWARD_MAX_PIXELS,
    REWARD_MIN_PIXELS,
    REWARD_SAMPLE_FPS,
    VIDEO_FPS,
    Config,
    RewardConfig,
    check_values,
    parse_bool,
)
from sage_grpo.errors import SageGRPOError  # noqa: E402

VIDEO_COLUMNS = ("video_path", "video", "path")
# the flags of the metrics vlm_judge and remote: the training flags of the same names (defaults and help from
# RewardConfig)
SERVER_FLAGS = ("judge_url", "judge_model", "judge_template", "judge_scale", "judge_frames", "judge_video",
                "judge_concurrency", "judge_max_tokens", "judge_allow_http_key", "reward_timeout", "reward_retries")


def warn(message: str) -> None:
    """One line on stderr for a video that is scored with a caveat or not at all."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _prompt_for(video: Path) -> tuple[str, bool]:
    """(prompt, from_txt): the exact prompt in <name>.txt beside the video, else the file name."""
    from sage_grpo.video import read_prompt_file

    prompt = read_prompt_file(video)
    return (prompt, True) if prompt is not None else (video.stem.replace("_", " "), False)


def list_inputs(src: Path) -> tuple[list[tuple[Path, str]], list[str]]:
    """(video path, prompt) pairs from a folder of mp4s, one mp4, or a prompt CSV, and the names of the videos whose
    prompt was taken from the file name (no <name>.txt)."""
    if not src.exists():
        raise SageGRPOError(
            f"--videos {src} does not exist: give a folder of .mp4 files, one .mp4 or a CSV with prompt + video_path"
        )
    if src.is_dir() or src.suffix.lower() == ".mp4":
        vids = sorted(src.glob("*.mp4")) if src.is_dir() else [src]
        if not vids:
            raise SageGRPOError(f"no .mp4 files in {src}")
        pairs, guessed = [], []
        for v in vids:
            prompt, from_txt = _prompt_for(v)
            pairs.append((v, prompt))
            if not from_txt:
                guessed.append(v.name)
        return pairs, guessed
    if src.suffix.lower() != ".csv":
        raise SageGRPOError(f"--videos {src}: give a folder of .mp4 files, one .mp4 or a .csv with prompt + video_path")
    try:
        with src.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            cols = set(reader.fieldnames or ())
    except (UnicodeDecodeError, csv.Error) as err:
        raise SageGRPOError(f"cannot read {src} as a UTF-8 CSV: {err}") from None
    vcol = next((c for c in VIDEO_COLUMNS if c in cols), None)
    if "prompt" not in cols or vcol is None:
        raise SageGRPOError(
            f"{src} needs a 'prompt' column and one of {', '.join(VIDEO_COLUMNS)}; found columns {sorted(cols)}"
        )
    if not rows:
        raise SageGRPOError(f"{src} has a header but no rows")
    pairs = []
    for i, r in enumerate(rows):
        p = Path(r[vcol] or "")
        p = p if p.is_absolute() else src.parent / p
        if not p.is_file():
            raise SageGRPOError(f"{src} row {i + 2}: video {p} does not exist")
        pairs.append((p, r["prompt"] or ""))
    return pairs, []


def metric_names(spec: str) -> list[str]:
    """The comma-separated names, each checked against the registry before any model loads."""
    from sage_grpo.rewards import get_reward_builder

    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise SageGRPOError("--metrics is empty")
    for n in names:
        try:
            get_reward_builder(n)  # an unknown name raises with the closest name and the list of valid ones
        except SageGRPOError as err:
            raise SageGRPOError(str(err).replace("--reward_model", "--metrics")) from None
    return names


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
        reward_url=args.reward_url,
        **{name: getattr(args, name) for name in SERVER_FLAGS},
    )
    if args.min_pixels:
        kwargs["min_pixels"] = args.min_pixels
    return {n: get_reward_builder(n)(**kwargs) for n in metric_names(args.metrics)}


def score_all(pairs: list[tuple[Path, str]], metrics: dict, device: str, video_fps: float) -> list[dict]:
    """One row per video: file, prompt and every metric component (NaN where decoding or scoring failed)."""
    import torch

    from sage_grpo.rewards.base import score_safely
    from sage_grpo.video import read_video

    comps = [c for m in metrics.values() for c in m.components]
    rows = []
    for path, prompt in pairs:
        row = {"video": str(path), "prompt": prompt}
        try:
            frames, fps = read_video(path)
        except SageGRPOError as err:
            warn(f"{err}; its scores are NaN")
            rows.append({**row, **{c: math.nan for c in comps}})
            continue
        if fps and abs(fps - video_fps) > 0.5:
            warn(f"{path} is {fps:g} fps but frames are sampled assuming --video_fps {video_fps:g}")
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
    with out.with_suffix(".csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
        w.writerow({"video": "MEAN", "prompt": "", **means})
    clean = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]
    js = {"videos": clean, "means": {k: (None if math.isnan(v) else v) for k, v in means.items()}, "n_failed": failed}
    out.with_suffix(".json").write_text(json.dumps(js, indent=2, ensure_ascii=False), encoding="utf-8")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags (reward flags share the training flags' names)."""
    ap = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--videos", required=True, help="folder of .mp4 files, one .mp4, or CSV with prompt + video_path "
                                                    "columns")
    ap.add_argument("--out", required=True, help="output prefix: writes <out>.csv and <out>.json")
    ap.add_argument("--metrics", default="videoalign_local,clipscore,pickscore", help="comma-separated reward names")
    r = Config().reward  # the training flags' defaults
    ap.add_argument("--pretrained_model_root", default=Config().model.pretrained_model_root,
                    help="root of the reward weights (default: %(default)s)")
    ap.add_argument("--reward_model_path", default="", help="default <root>/VideoReward")
    ap.add_argument("--reward_base_model_path", default="", help="default <root>/Qwen2-VL-2B-Instruct")
    ap.add_argument("--reward_checkpoint_mode", default=r.reward_checkpoint_mode, choices=("v1", "v2", "v3"),
                    help="key remapping of the VideoReward checkpoint (default: %(default)s)")
    ap.add_argument("--clip_model_path", default="",
                    help="default <root>/clip-vit-large-patch14 (openai/clip-vit-large-patch14)")
    ap.add_argument("--pickscore_model_path", default="",
                    help="default <root>/PickScore_v1 (yuvalkirstain/PickScore_v1)")
    ap.add_argument("--pickscore_processor_path", default="", help="default <root>/CLIP-ViT-H-14-laion2B-s32B-b79K "
                    "(laion/CLIP-ViT-H-14-laion2B-s32B-b79K, tokenizer and processor files only)")
    ap.add_argument("--reward_url", default="", help="for the metric `remote`: reward server URL(s) "
                    "(scripts/serve_reward.py), comma-separated; token from SAGE_REWARD_TOKEN")
    meta = {f.name: f.metadata for f in dataclasses.fields(RewardConfig)}
    for name in SERVER_FLAGS:
        default = getattr(r, name)
        kind = dict(type=type(default))
        if isinstance(default, bool):  # --judge_video, --judge_video true, as in training
            kind = dict(type=lambda v, n=name: parse_bool(v, f"--{n}"), nargs="?", const=True, metavar="BOOL")
        ap.add_argument(f"--{name}", default=default, choices=meta[name]["choices"],
                        help=f"{meta[name]['help']} (default: {default!r})".replace("--reward_model", "--metrics")
                        .replace("%", "%%"), **kind)
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    ap.add_argument("--dtype", default=r.reward_dtype, choices=DTYPES, help="reward model dtype (default: %(default)s)")
    ap.add_argument("--max_pixels", type=int, default=REWARD_MAX_PIXELS,
                    help="max pixels per frame fed to VideoAlign (default: %(default)s)")
    ap.add_argument("--min_pixels", type=int, default=0, help=f"0 = VideoAlign's default ({REWARD_MIN_PIXELS})")
    ap.add_argument("--sample_fps", type=float, default=REWARD_SAMPLE_FPS,
                    help="frames per second sampled from each video (default: %(default)s)")
    ap.add_argument("--video_fps", type=float, default=float(VIDEO_FPS),
                    help="frame rate of the videos (default: %(default)s)")
    ap.add_argument("--verbose", action="store_true", help="show the libraries' warnings and progress bars")
    return ap.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Every flag's value, with the config's reward rules, before any model loads."""
    import torch

    at_least("--max_pixels", args.max_pixels, 1)
    at_least("--min_pixels", args.min_pixels, 0)
    at_least("--sample_fps", args.sample_fps, 0, strict=True)
    at_least("--video_fps", args.video_fps, 0, strict=True)
    cfg = Config()
    cfg.reward.reward_max_pixels, cfg.reward.reward_sample_fps = args.max_pixels, args.sample_fps
    cfg.reward.reward_min_pixels = args.min_pixels or cfg.reward.reward_min_pixels
    if args.min_pixels == 0 and args.max_pixels < cfg.reward.reward_min_pixels:
        raise SageGRPOError(f"--max_pixels {args.max_pixels} is below VideoAlign's default --min_pixels "
                            f"{cfg.reward.reward_min_pixels}; give --min_pixels too")
    try:
        check_values(cfg)
    except SageGRPOError as err:
        raise SageGRPOError(str(err).replace("--reward_", "--")) from None
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(args.device)
    except (RuntimeError, ValueError):
        raise SageGRPOError(f"--device {args.device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SageGRPOError(f"--device {args.device}: CUDA is not available here; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SageGRPOError(f"--device {args.device}: this machine has {torch.cuda.device_count()} GPUs")
    check_server_flags(args, metric_names(args.metrics))
    out = Path(args.out)
    for path in (out.with_suffix(".csv"), out.with_suffix(".json")):
        check_output_file(path, "--out", create=False)  # write_tables makes the folder


def check_server_flags(args: argparse.Namespace, names: list[str]) -> None:
    """The flags of vlm_judge and remote, as training checks them: a judge URL exactly when the judge is chosen,
    counts >= 1, a template file that can be read, a timeout > 0."""
    from sage_grpo.config import check_judge_url, read_judge_template

    at_least("--judge_frames", args.judge_frames, 1)
    at_least("--judge_concurrency", args.judge_concurrency, 1)
    at_least("--judge_max_tokens", args.judge_max_tokens, 1)
    at_least("--reward_timeout", args.reward_timeout, 0, strict=True)
    at_least("--reward_retries", args.reward_retries, 0)
    judged = "vlm_judge" in (n.strip().lower() for n in names)
    if args.judge_url.strip() and not judged:
        raise SageGRPOError(f"--judge_url is only used by the metric vlm_judge; add it to --metrics (got --metrics "
                            f"{args.metrics})")
    if judged:
        if not args.judge_url.strip():
            raise SageGRPOError("--metrics vlm_judge needs --judge_url http://host:port (an OpenAI-compatible chat "
                                "server: vllm serve, python -m sglang.launch_server, transformers serve)")
        check_judge_url(args.judge_url)
        read_judge_template(args.judge_template)


def run(argv: list[str] | None) -> int:
    """Check everything, load the metrics, score, write; raises SageGRPOError on user errors."""
    args = parse_args(argv)
    check_args(args)
    pairs, guessed = list_inputs(Path(args.videos))
    from sage_grpo.video import check_mp4_support

    check_mp4_support()
    quiet_libraries(args.verbose)
    metrics = build_metrics(args)
    if guessed:
        warn(f"{len(guessed)} of {len(pairs)} videos have no <name>.txt beside them; their prompts were taken from "
             f"the file names (e.g. {guessed[0]}), which TA, CLIPScore and PickScore then score against")
    rows = score_all(pairs, metrics, args.device, args.video_fps)
    out = Path(args.out)
    write_tables(rows, out)
    means, failed = summarise(rows)
    tables = f"{out.with_suffix('.csv')}, {out.with_suffix('.json')}"
    dead = [k for k, n in failed.items() if n == len(rows)]
    if dead:
        what = ("every video failed to score" if len(dead) == len(means)
                else f"no video could be scored for {', '.join(dead)}")
        raise SageGRPOError(f"{what} ({videos(len(rows))}; see the warnings above); the tables are in {tables}")
    print(f"scored {videos(len(rows))} -> {tables}")
    for k, v in means.items():
        print(f"  {k:>12s}: {v: .4f}" + (f"  ({failed[k]} failed)" if failed[k] else ""))
    return 0


def videos(n: int) -> str:
    return f"{n} video{'' if n == 1 else 's'}"


def main(argv: list[str] | None = None) -> int:
    """Run; user errors print one `error:` line to stderr and return 2."""
    try:
        return run(argv)
    except SageGRPOError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
