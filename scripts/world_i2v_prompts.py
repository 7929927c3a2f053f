#!/usr/bin/env python
"""Image-to-video prompt files for the tiny world model: each caption of a prompt file with the first frame of its
rendered clip (layout from its row number) as the reference image, so the I2V checkpoint
(assets/tiny_world/hunyuanvideo15_i2v) trains and validates on world captions. Only captions that move left, right,
up or down are kept (the `world_motion` reward scores a direction; a bounce has none).

    python scripts/world_i2v_prompts.py --captions configs/world_prompts.txt --out configs/world_i2v/train
    python scripts/world_i2v_prompts.py --captions configs/world_heldout_prompts.txt --out configs/world_i2v/heldout

Writes <out>/prompts.csv (columns prompt, ref_image_path relative to it) and <out>/first_frame_NNN.png; the committed
folders under configs/world_i2v/ are this script's output for those two commands (tested).
"""

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.errors import run_cli  # noqa: E402


def main(argv=None) -> Path:
    from sage_grpo.cli import CLIParser, check_writable_dir

    ap = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--captions", required=True, help="prompt file of world captions (.txt, .csv or .jsonl)")
    ap.add_argument("--out", required=True, help="folder to write prompts.csv and the first frames to")
    args = ap.parse_args(argv)
    check_writable_dir(args.out, "--out")
    from sage_grpo.data import read_prompts
    from sage_grpo.world.captions import parse_caption
    from sage_grpo.world.evaluate import write_first_frames

    records = read_prompts(args.captions)  # one clear line for a missing or bad file
    rows = [(r.index, r.prompt) for r in records if parse_caption(r.prompt).motion != "bounces"]
    out = Path(args.out)
    paths, _ = write_first_frames([p for _, p in rows], [i for i, _ in rows], out)
    with open(out / "prompts.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["prompt", "ref_image_path"])
        w.writerows((prompt, Path(path).name) for (_, prompt), path in zip(rows, paths))
    print(f"wrote {len(rows)} prompts with their first frames to {out / 'prompts.csv'}")
    return out / "prompts.csv"


if __name__ == "__main__":
    run_cli(main)
