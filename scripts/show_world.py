#!/usr/bin/env python
"""A grid PNG of a few synthetic-world clips (one row per clip, one column per frame) with their captions and what
the detectors read back, so a person can check the world by eye.

    python scripts/show_world.py --out outputs/world/show_world.png --n 6 --seed 0 --split train
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.errors import run_cli  # noqa: E402


def readout(video) -> str:
    """What the detectors see in a clip [F, 3, H, W], in caption words."""
    from sage_grpo.world.detectors import detect

    det = detect(video)
    objs = ", ".join(f"{o.size} {o.color} {o.shape} {o.motion} (iou {o.shape_iou:.2f})" for o in det.objects)
    return f"detected: {objs or 'no object'} on {det.background}"


def main(argv=None) -> Path:
    """Render ``--n`` clips of ``(--seed, --split)`` and write the grid to ``--out``; returns the path."""
    from sage_grpo.cli import CLIParser, at_least, check_output_file

    ap = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="outputs/world/show_world.png", help="PNG to write")
    ap.add_argument("--n", type=int, default=6, help="number of clips (rows)")
    ap.add_argument("--seed", type=int, default=0, help="world seed")
    ap.add_argument("--split", default="train", help="train or heldout")
    ap.add_argument("--size", type=int, default=32, help="frame side in px (multiple of 16)")
    ap.add_argument("--frames", type=int, default=9, help="frames per clip (4k+1)")
    ap.add_argument("--two_object_prob", type=float, default=0.3, help="share of clips with two objects")
    args = ap.parse_args(argv)
    at_least("--n", args.n, 1)
    out = check_output_file(args.out, "--out")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from sage_grpo.world.sampler import sample_clip

    torch.set_num_threads(1)
    clips = [sample_clip(args.seed, i, args.split, args.size, args.frames, args.two_object_prob) for i in range(args.n)]
    height = 1.45 * args.n + 0.4  # inches: a row per clip with its two caption lines, and the title on top
    fig, axes = plt.subplots(args.n, args.frames, figsize=(1.1 * args.frames, height), squeeze=False)
    for row, clip in zip(axes, clips):
        frames = clip.video.permute(0, 2, 3, 1).numpy()  # [F, H, W, 3]
        for f, ax in enumerate(row):
            ax.imshow(frames[f], interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
        row[0].set_title(f"{clip.caption}\n{readout(clip.video)}", loc="left", fontsize=7)
    fig.suptitle(f"world clips: seed {args.seed}, split {args.split}, {args.frames} frames of {args.size} px "
                 "(frame 0 on the left)", fontsize=9, y=1 - 0.12 / height)
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=1 - 0.75 / height, hspace=0.9, wspace=0.08)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    run_cli(main)
