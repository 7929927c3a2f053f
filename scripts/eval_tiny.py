#!/usr/bin/env python
"""Measure what the tiny world model draws: ODE videos of held-out captions (colour-shape pairs never seen in
pretraining) with fixed seeds, read back by the world's detectors.

    python scripts/eval_tiny.py                                  # the committed model, 42 held-out captions
    python scripts/eval_tiny.py --model_path /tmp/world --num_captions 84 --out outputs/eval_tiny
    python scripts/eval_tiny.py --i2v                            # the image-to-video checkpoint, first frames given

Reports the share of videos whose object colour, shape and motion direction (also size and background) match the
caption, the frames' sharpness relative to rendered clips of the same captions, and temporal consistency, against
the targets colour >= 0.8, shape >= 0.5, direction >= 0.6. Writes eval.json (benchmark format), eval.md and
grid.png (the first --grid videos, 5 frames each) to --out.

--i2v evaluates the image-to-video checkpoint (default assets/tiny_world/hunyuanvideo15_i2v): each caption's first
frame is rendered (layout from the caption's index), written to --out/first_frames/ and given as the reference image;
it adds first_frame_error, the mean absolute pixel difference between the video's first frame and that image.
--centred puts the object of each first frame at the frame centre: rendered clips start an object on the side it
moves away from, so the first frame alone hints at the direction; from the centre only the caption tells it.
motion_small and motion_large are the direction shares of the captions with a small and a large object.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.cli import CLIParser, check_writable_dir, quiet_libraries  # noqa: E402
from sage_grpo.errors import SageGRPOError, run_cli  # noqa: E402
from sage_grpo.world.pretrain import WORLD_GUIDANCE_SCALE, WORLD_I2V_MODEL_DIR, WORLD_MODEL_DIR  # noqa: E402

DEFAULT_STEPS, DEFAULT_CFG = 20, WORLD_GUIDANCE_SCALE


def write_grid(videos, captions: list[str], path: Path, cols: int = 5) -> Path:
    """Rows: videos (caption above), columns: `cols` frames spread over the clip."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(captions)
    fig, axes = plt.subplots(n, cols, figsize=(cols * 1.1, n * 1.3), squeeze=False)
    for i, (video, caption) in enumerate(zip(videos, captions)):
        idx = [round(k * (video.shape[0] - 1) / (cols - 1)) for k in range(cols)]
        for c, f in enumerate(idx):
            ax = axes[i][c]
            ax.imshow(video[f].permute(1, 2, 0).clamp(0, 1).numpy(), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
        axes[i][0].set_title(caption, fontsize=6, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    p = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_path", default="", help=f"diffusers-layout model (default: {WORLD_MODEL_DIR}, with --i2v "
                                                    f"{WORLD_I2V_MODEL_DIR})")
    p.add_argument("--i2v", action="store_true", help="image-to-video: the caption's rendered first frame is given")
    p.add_argument("--centred", action="store_true",
                   help="with --i2v: each first frame's object at the frame centre (the direction from the caption "
                        "only)")
    p.add_argument("--num_captions", type=int, default=42, help="held-out captions to sample (default: 42)")
    p.add_argument("--split", choices=("heldout", "train"), default="heldout", help="caption split (default: heldout)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"ODE steps (default: {DEFAULT_STEPS})")
    p.add_argument("--cfg_scale", type=float, default=DEFAULT_CFG, help=f"guidance scale (default: {DEFAULT_CFG})")
    p.add_argument("--seed", type=int, default=0, help="noise seed (default: 0)")
    p.add_argument("--grid", type=int, default=8, help="videos drawn in grid.png (default: 8; 0 = none)")
    p.add_argument("--out", default="outputs/eval_tiny", help="report folder (default: outputs/eval_tiny)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.num_captions < 1 or a.grid < 0:
        raise SageGRPOError("--steps and --num_captions must be at least 1 and --grid at least 0")
    if a.centred and not a.i2v:
        raise SageGRPOError("--centred places the first frame's object: it needs --i2v")
    check_writable_dir(a.out, "--out")
    a.model_path = a.model_path or (WORLD_I2V_MODEL_DIR if a.i2v else WORLD_MODEL_DIR)
    from sage_grpo.models.loading import checkpoint_task, locate_model
    from sage_grpo.world.evaluate import (
        TARGETS,
        eval_captions,
        first_frame_error,
        quality,
        sample_world_videos,
        write_first_frames,
    )
    from sage_grpo.world.sampler import single_object_attributes

    total = len(single_object_attributes(a.split))
    if a.num_captions > total:
        raise SageGRPOError(f"--num_captions {a.num_captions}: the {a.split} split has {total} one-object captions")
    task = checkpoint_task(locate_model("", a.model_path))  # a missing model is one line, before anything loads
    if task != ("i2v" if a.i2v else "t2v"):
        what = {"i2v": "an image-to-video", "t2v": "a text-to-video"}[task]
        raise SageGRPOError(f"--model_path {a.model_path} is {what} checkpoint; "
                            + ("drop --i2v" if a.i2v else "add --i2v") + " or give the other checkpoint")
    quiet_libraries()
    import torch

    from sage_grpo.models.loading import load_pipeline

    t0 = time.perf_counter()
    pipe = load_pipeline("", a.model_path, dtype=torch.float32)
    captions = eval_captions(a.num_captions, a.split)
    seeds = list(range(len(captions)))
    out = Path(a.out)
    paths = None
    if a.i2v:
        paths, references = write_first_frames(captions, seeds, out / "first_frames", centred=a.centred)
    videos = sample_world_videos(pipe, captions, steps=a.steps, cfg_scale=a.cfg_scale, seed=a.seed, image_paths=paths)
    q = quality(videos, captions, seeds=seeds)
    if a.i2v:
        q["first_frame_error"] = float(first_frame_error(videos, references).mean())
    seconds = time.perf_counter() - t0
    passed = {k: q[k] >= v for k, v in TARGETS.items()}
    result = {"benchmark": "eval_tiny", "model_path": a.model_path, "task": task, "split": a.split, "steps": a.steps,
              "cfg_scale": a.cfg_scale, "centred": a.centred, "seed": a.seed, "quality": q, "targets": TARGETS,
              "passed": passed, "seconds": round(seconds, 1), "torch": torch.__version__}
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    n = len(captions)
    rows = [f"{n} {a.split} captions (one video each, noise seed {a.seed}, {a.steps} ODE steps, CFG {a.cfg_scale:g}): "
            f"each share moves in steps of 1/{n}; docs/world_model.md's figures are of the default 42 captions.", "",
            "| measure | value | target |", "|---|---|---|"]
    for k in ("color", "shape", "motion", "motion_small", "motion_large", "size", "background", "sharpness_ratio",
              "temporal_consistency",
              *(["first_frame_error"] if a.i2v else [])):
        target = f">= {TARGETS[k]}" if k in TARGETS else ""
        rows.append(f"| {k} | {q[k]:.3f} | {target} |")
    (out / "eval.md").write_text("\n".join(rows) + "\n")
    if a.grid:
        write_grid(videos[: a.grid], captions[: a.grid], out / "grid.png")
    print("\n".join(rows))
    missed = [k for k, ok in passed.items() if not ok]
    print(f"{len(captions)} {a.split} captions ({task}), {a.steps} ODE steps, cfg {a.cfg_scale}: {seconds:.0f} s; "
          f"targets {'NOT met: ' + ', '.join(missed) if missed else 'met'}")
    return result


if __name__ == "__main__":
    run_cli(main)
