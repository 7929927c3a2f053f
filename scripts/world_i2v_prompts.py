#!/usr/bin/env python
"""Image-to-video prompt files for the tiny world model: world captions, each with the first frame of its rendered
clip (layout from its row number) as the reference image, so the I2V checkpoint
(assets/tiny_world/hunyuanvideo15_i2v) trains and validates on them. Only captions that move left, right, up or down
are kept (the `world_motion` reward scores a direction; a bounce has none).

    python scripts/world_i2v_prompts.py --captions configs/world_prompts.txt --out configs/world_i2v/train
    python scripts/world_i2v_prompts.py --captions configs/world_heldout_prompts.txt --out configs/world_i2v/heldout
    # the demo's motion task: small objects that start at the frame centre (the direction from the caption only)
    python scripts/world_i2v_prompts.py --grid train --num 96 --size small --centred \
        --out configs/world_i2v_motion/train
    python scripts/world_i2v_prompts.py --grid heldout --num 16 --size small --centred \
        --out configs/world_i2v_motion/heldout

The captions come from a prompt file (--captions) or from the world's exhaustive one-object grid of a split (--grid:
--num captions spread evenly over it, in a fixed shuffled order; the held-out split's colour-shape pairs were never
seen in pretraining).
--size keeps one object size; --centred draws each first frame with its object at the frame centre (rendered clips
start an object on the side it moves away from, so there the first frame hints at the direction).

Writes <out>/prompts.csv (columns prompt, ref_image_path relative to it) and <out>/first_frame_NNN.png; the committed
folders under configs/world_i2v/ and configs/world_i2v_motion/ are this script's output for those commands (tested).
"""

import argparse
import csv
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.errors import run_cli  # noqa: E402


def main(argv=None) -> Path:
    from sage_grpo.cli import CLIParser, check_writable_dir
    from sage_grpo.errors import SageGRPOError

    ap = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--captions", help="prompt file of world captions (.txt, .csv or .jsonl)")
    src.add_argument("--grid", choices=("train", "heldout"), help="the one-object caption grid of this split")
    ap.add_argument("--num", type=int, default=None, help="with --grid: how many captions, spread evenly over it "
                                                          "(default: all)")
    ap.add_argument("--size", choices=("small", "large"), default=None, help="keep only objects of this size")
    ap.add_argument("--centred", action="store_true", help="each first frame's object at the frame centre")
    ap.add_argument("--out", required=True, help="folder to write prompts.csv and the first frames to")
    args = ap.parse_args(argv)
    if args.num is not None and (args.grid is None or args.num < 1):
        raise SageGRPOError("--num needs --grid and must be at least 1")
    check_writable_dir(args.out, "--out")
    from sage_grpo.world.captions import make_caption, parse_caption
    from sage_grpo.world.evaluate import write_first_frames

    if args.captions:
        from sage_grpo.data import read_prompts

        captions = [r.prompt for r in read_prompts(args.captions)]  # one clear line for a missing or bad file
    else:
        from sage_grpo.world.sampler import single_object_attributes

        captions = [make_caption(a) for a in single_object_attributes(args.grid)]

    def keep(caption: str) -> bool:
        attrs = parse_caption(caption)
        return attrs.motion != "bounces" and (args.size is None or all(o.size == args.size for o in attrs.objects))

    rows = [(i, c) for i, c in enumerate(captions) if keep(c)]  # the row number seeds the layout
    if args.num is not None:
        if args.num > len(rows):
            raise SageGRPOError(f"--num {args.num}: the {args.grid} grid has {len(rows)} such captions")
        rows = [rows[(k * len(rows)) // args.num] for k in range(args.num)]
    if args.grid:  # the grid's order runs colour by colour: shuffled (fixed seed), the first rows span the grid
        random.Random(0).shuffle(rows)  # (scripts/demo_compare.py shows the first rows of a run's prompt file)
    if not rows:
        raise SageGRPOError("no caption moves left, right, up or down with those options")
    out = Path(args.out)
    paths, _ = write_first_frames([p for _, p in rows], [i for i, _ in rows], out, centred=args.centred)
    with open(out / "prompts.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["prompt", "ref_image_path"])
        w.writerows((prompt, Path(path).name) for (_, prompt), path in zip(rows, paths))
    print(f"wrote {len(rows)} prompts with their first frames to {out / 'prompts.csv'}")
    return out / "prompts.csv"


if __name__ == "__main__":
    run_cli(main)
