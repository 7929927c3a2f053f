#!/usr/bin/env python
"""Write a tiny random HunyuanVideo-1.5 (same classes, tiny configs, in-process tokenizers) for CPU smoke tests.

    python scripts/make_tiny_checkpoint.py --out outputs/tiny_ckpts/hunyuanvideo15               # diffusers layout
    python scripts/make_tiny_checkpoint.py --out outputs/tiny_ckpts/authors --layout authors     # authors' layout
    python scripts/make_tiny_checkpoint.py --out outputs/tiny_ckpts/hv15_i2v --version 480p_i2v  # image-to-video

It loads through exactly the code path of the real weights (sage_grpo.models.loading.load_pipeline); the text
lengths the pipeline keeps as attributes are stored in sage_grpo_text_lengths.json next to the weights. A version
whose name holds "i2v" writes an image-to-video checkpoint: the transformer configured for I2V and a tiny SigLIP
image encoder with its processor (diffusers: image_encoder/ + feature_extractor/; authors: vision_encoder/siglip/).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.cli import CLIParser, check_writable_dir, quiet_libraries  # noqa: E402
from sage_grpo.errors import run_cli  # noqa: E402
from sage_grpo.models.tiny_checkpoint import TINY_CHECKPOINT_DIR, write_tiny_checkpoint  # noqa: E402


def main() -> None:
    p = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=TINY_CHECKPOINT_DIR, help=f"output directory (default: {TINY_CHECKPOINT_DIR})")
    p.add_argument("--layout", choices=("diffusers", "authors"), default="diffusers")
    p.add_argument("--seed", type=int, default=0, help="weight seed (same seed = same weights in both layouts)")
    p.add_argument("--version", default="480p_t2v", help="authors' transformer sub-folder name; a name with i2v "
                   "(e.g. 480p_i2v) writes an image-to-video checkpoint with its SigLIP image encoder")
    a = p.parse_args()
    check_writable_dir(a.out, "--out")
    quiet_libraries()
    t0 = time.time()
    out = write_tiny_checkpoint(a.out, a.layout, a.seed, a.version)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
    print(f"wrote tiny HunyuanVideo-1.5 {a.version} ({a.layout} layout) to {out} ({size:.1f} MiB, "
          f"{time.time() - t0:.1f} s)")


if __name__ == "__main__":
    run_cli(main)
