#!/usr/bin/env python
"""Write a tiny random VideoReward checkpoint (authors' layout) and a tiny Qwen2-VL-2B-Instruct-shaped base.

    python scripts/make_tiny_videoalign.py --out ckpts_tiny/VideoReward --base-out ckpts_tiny/Qwen2-VL-2B-Instruct

The checkpoint holds checkpoint-2/ and checkpoint-8/ (newest), each with the full model.pth and the LoRA-only
adapter_model.safetensors + non_lora_state_dict.pth, keys in the transformers-4.4x layout (``--layout new`` for the
current one), so loading exercises remapping and LoRA merging. Random weights: the scores mean nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.cli import CLIParser, check_writable_dir  # noqa: E402
from sage_grpo.errors import run_cli  # noqa: E402
from sage_grpo.rewards.tiny import write_tiny_base, write_tiny_videoreward  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, write both directories, print their sizes."""
    ap = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="VideoReward directory to write")
    ap.add_argument("--base-out", default="", help="base model directory (default: <out>/../Qwen2-VL-2B-Instruct)")
    ap.add_argument("--layout", choices=("old", "new"), default="old", help="checkpoint key layout (old = published)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    base = Path(args.base_out) if args.base_out else out.parent / "Qwen2-VL-2B-Instruct"
    check_writable_dir(out, "--out")
    check_writable_dir(base, "--base-out")
    write_tiny_base(base, seed=args.seed)
    write_tiny_videoreward(out, base, layout=args.layout, seed=args.seed + 1)
    for d in (base, out):
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        print(f"wrote {d} ({size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
