#!/usr/bin/env python
"""Pretrain the tiny world model: a HunyuanVideo-1.5 (same diffusers classes, tiny sizes) that draws the synthetic
world of sage_grpo.world, on a CPU. The committed model (assets/tiny_world/hunyuanvideo15) is this script's output
for the defaults; the demo and the video lab load it and never train it.

    python scripts/pretrain_tiny.py                                  # rewrites assets/tiny_world/hunyuanvideo15
    python scripts/pretrain_tiny.py --out /tmp/world --seed 1        # another seed elsewhere

Stages (sage_grpo/world/pretrain.py): render the training clips, train the VAE as an autoencoder, encode the clips
(and their first frames as image-to-video references), train the transformer by flow matching on the captions, a
share --i2v_prob of the batches conditioned on their first frames. Writes the text-to-video checkpoint to --out and
the image-to-video one (the same weights plus the tiny SigLIP) to <out>_i2v. Deterministic for a seed and
--threads. Resumable: killed and run again with the same flags, it takes its finished VAE stage and continues the
transformer from its last saved step (every --checkpoint_every steps, in <out>/pretrain_state/), to the same
weights. The seconds and CPU seconds of each stage are printed and saved in pretrain_info.json beside the weights
and, as a benchmark record, in --bench_out.
"""

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.cli import CLIParser, check_writable_dir, quiet_libraries  # noqa: E402
from sage_grpo.errors import SageGRPOError, run_cli  # noqa: E402
from sage_grpo.world.pretrain import WORLD_MODEL_DIR, PretrainSettings, pretrain, reusable_vae  # noqa: E402


def main() -> None:
    p = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=WORLD_MODEL_DIR, help=f"output directory (default: {WORLD_MODEL_DIR})")
    defaults = PretrainSettings()
    for f in fields(PretrainSettings):
        p.add_argument(f"--{f.name}", type=type(getattr(defaults, f.name)), default=getattr(defaults, f.name),
                       help=f"(default: {getattr(defaults, f.name)})")
    p.add_argument("--checkpoint_every", type=int, default=100, help="transformer steps between saves of the "
                   "stage's state, from which a killed run continues (default: 100)")
    p.add_argument("--bench_out", default="", help="also write the timings as JSON here (default: none)")
    p.add_argument("--reuse_vae", default="", help="model directory of an earlier run with the same VAE settings: "
                                                   "take its VAE (the stage is deterministic) instead of training one")
    a = p.parse_args()
    s = PretrainSettings(**{f.name: getattr(a, f.name) for f in fields(PretrainSettings)})
    for name in ("num_clips", "vae_steps", "vae_batch", "transformer_steps", "transformer_batch", "threads"):
        if getattr(s, name) < 1:
            raise SageGRPOError(f"--{name} must be at least 1, got {getattr(s, name)}")
    if a.checkpoint_every < 1:
        raise SageGRPOError(f"--checkpoint_every must be at least 1, got {a.checkpoint_every}")
    if not 0.0 <= s.caption_dropout < 1.0 or not 0.0 <= s.ema_decay < 1.0:
        raise SageGRPOError("--caption_dropout and --ema_decay must be in [0, 1)")
    if not 0.0 <= s.i2v_prob <= 1.0 or s.object_weight < 0:
        raise SageGRPOError("--i2v_prob must be in [0, 1] and --object_weight at least 0")
    check_writable_dir(a.out, "--out")
    if a.reuse_vae:
        reusable_vae(s, a.reuse_vae)  # one line before anything is built
    quiet_libraries()
    info = pretrain(s, a.out, reuse_vae=a.reuse_vae or None, checkpoint_every=a.checkpoint_every)
    print(f"wrote the tiny world model to {a.out}: {info['seconds']:.0f} s "
          f"({info['cpu_seconds']:.0f} CPU s on {s.threads} threads)")
    if a.bench_out:
        Path(a.bench_out).write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    run_cli(main)
