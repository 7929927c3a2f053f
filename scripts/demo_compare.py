#!/usr/bin/env python
"""Before/after of a training run: the same prompts and seeds sampled (ODE, the validation settings of the run's
config) with the base weights and with the run's last checkpoint, scored by the run's reward, written as mp4s and a
side-by-side frame strip, the paired change of that reward (after - before on the same prompt and noise, its mean
over the prompts in standard errors); the learning statistics of metrics.jsonl (mean rollout reward of the first
and last 10 steps, their difference in standard errors); and what the run's hacking check said (train_state.json of
the last checkpoint, the shifts from metrics.jsonl).

    python scripts/demo_compare.py --run outputs/tiny_run --out outputs/demo/before_after

With --expect t2v|i2v (scripts/demo.sh) it also prints a verdict: whether the paired change lies inside the range
that `bash scripts/demo.sh` was measured to print (EXPECTED below, docs/world_model.md#what-bash-scriptsdemosh-shows),
and the hacking check's outcome beside the measured one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.errors import SageGRPOError, run_cli  # noqa: E402


def _mean_var(x: list[float]) -> tuple[float, float]:
    """Mean and sample variance (n - 1) of at least two numbers."""
    m = sum(x) / len(x)
    return m, sum((v - m) ** 2 for v in x) / (len(x) - 1)


# What `bash scripts/demo.sh` was measured to print (docs/world_model.md#what-bash-scriptsdemosh-shows): the paired
# change of the trained reward on the 32 training captions, in standard errors, over training seeds and machines,
# widened by one standard error each side (the statistic's own noise); a run outside the range is unexpected.
EXPECTED = {
    "t2v": {"config": "configs/tiny_world.yaml", "reward": "world_size", "range": (3.2, 5.5),
            "measured": "+4.27, +4.33, +4.50 in 3 runs: seeds 42 and 1 at one thread and seed 42 at two, 2-core CPUs",
            "hacking": "silent in all 3; background cleanliness -0.6 to -1.6 spreads by step 40 with the reward "
                       "under the 1-spread gate"},
    "i2v": {"config": "configs/tiny_world_i2v_motion.yaml", "reward": "world_motion", "range": (4.5, 8.2),
            "measured": "+5.56, +7.20, +7.20 in 3 runs: seeds 1 and 42 at one thread and seed 42 at two, 2-core CPUs",
            "hacking": "seed 42 fires at step 30 on world_background_cleanliness (-1.11 spreads); seed 1 silent"},
}
DOCS = "docs/world_model.md#what-bash-scriptsdemosh-shows"


def verdict(kind: str, std_errors: float) -> str:
    """One line: is `std_errors` (the paired change) inside the documented range of demo part `kind`?"""
    e = EXPECTED[kind]
    lo, hi = e["range"]
    head = f"{kind}: {e['reward']} paired change {std_errors:+.2f} standard errors"
    rng = f"the documented range [{lo:.1f}, {hi:.1f}] ({e['measured']})"
    if lo <= std_errors <= hi:  # NaN compares False
        return f"expected: {head}, inside {rng}"
    return f"UNEXPECTED: {head}, outside {rng}: see {DOCS}"


def hacking_summary(run: Path, checkpoint: Path) -> dict:
    """What the run's hacking check said: {metric: step of its warning} from the last checkpoint's train_state.json
    (post_train validates before it saves), each with its shift in spreads at that step from metrics.jsonl, and a
    line for people ("silent over the validations at steps 0, 10, ..." or "fired at step 30 on METRIC (-1.11
    spreads)"), followed by how near the gates the last validation came (the reward's rise, the largest fall)."""
    state = json.loads((checkpoint / "train_state.json").read_text())
    warned = {k: int(s) for k, s in (state.get("hacking_warned") or {}).items()}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    validated = [r["step"] for r in rows if "val/hacking_warnings" in r and "step" in r]
    shifts = {}
    for metric, step in warned.items():
        at = [r.get(f"val_shift/{metric}") for r in rows if r.get("step") == step]
        shifts[metric] = next((float(v) for v in at if v is not None), math.nan)
    if warned:
        line = "fired " + ", ".join(f"at step {s} on {m} ({shifts[m]:+.2f} spreads)"
                                    for m, s in sorted(warned.items(), key=lambda x: x[1]))
    else:
        seen = f" over the validations at steps {', '.join(map(str, validated))}" if validated else ""
        line = f"silent{seen}"
    last = next((r for r in reversed(rows) if "val/hacking_warnings" in r), None)
    if last is not None:  # how near the gates the last validation came: the reward's rise, the largest fall
        falls = {k[len("val_shift/"):]: v for k, v in last.items()
                 if k.startswith("val_shift/") and k != "val_shift/reward_total" and v is not None and v < 0}
        near = [f"held-out reward {last.get('val_shift/reward_total', math.nan):+.2f} spreads at step {last['step']}"]
        if falls:
            worst = min(falls, key=falls.get)
            near.append(f"largest fall {worst} {falls[worst]:+.2f}")
        line += f" ({'; '.join(near)})"
    return {"hacking_warned": warned, "hacking_shift": shifts, "hacking_check": line}


def learning_stats(metrics_path: Path, window: int = 10) -> dict:
    """Mean rollout reward of the first and last `window` steps and (last - first) / standard error."""
    rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    r = [row["reward/total_mean"] for row in rows if row.get("reward/total_mean") is not None]
    if len(r) < 2 * window:
        raise SageGRPOError(f"{metrics_path} has {len(r)} steps; the comparison needs at least {2 * window}")
    first, last = r[:window], r[-window:]
    (m1, v1), (m2, v2) = _mean_var(first), _mean_var(last)
    se = math.sqrt(v1 / window + v2 / window)
    return {"steps": len(r), "first_mean": m1, "last_mean": m2, "std_errors": (m2 - m1) / se if se > 0 else math.inf}


def paired_stats(before: list[float], after: list[float]) -> dict:
    """The mean of after - before over paired samples (same prompt, same noise) and that mean / its standard error
    (inf when every pair moved by the same amount, NaN for fewer than two pairs)."""
    diff = [a - b for a, b in zip(after, before, strict=True)]
    n = len(diff)
    if n < 2:
        return {"paired_change": diff[0] if diff else math.nan, "paired_std_errors": math.nan}
    mean, var = _mean_var(diff)
    se = math.sqrt(var / n)
    if se == 0:
        return {"paired_change": mean, "paired_std_errors": math.copysign(math.inf, mean) if mean else math.nan}
    return {"paired_change": mean, "paired_std_errors": mean / se}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="output_dir of a post_train.py run (config.yaml, metrics.jsonl, "
                                                "checkpoint-N)")
    p.add_argument("--out", required=True, help="folder for the before/after videos and strip.png")
    p.add_argument("--prompts", type=int, default=3,
                   help="how many prompts to compare (the first of the run's data.train_video_csv)")
    p.add_argument("--strip_prompts", type=int, default=4,
                   help="how many of those prompts the frame strip shows (all are scored and written as mp4s)")
    p.add_argument("--expect", choices=sorted(EXPECTED), default=None,
                   help="a run of scripts/demo.sh's part (t2v: configs/tiny_world.yaml, i2v: "
                        "configs/tiny_world_i2v_motion.yaml): also print whether the paired change lies inside "
                        "the range the demo was measured to print, and the hacking check beside the measured one")
    p.add_argument("--verbose", action="store_true",
                   help="show the libraries' warnings and progress bars (hidden by default, as in post_train.py)")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.strip_prompts < 1:
        raise SageGRPOError(f"--prompts and --strip_prompts must be >= 1, got {args.prompts} and {args.strip_prompts}")
    run = Path(args.run)
    if not (run / "config.yaml").is_file():
        raise SageGRPOError(f"--run {args.run!r} holds no config.yaml: pass a post_train.py output_dir")
    from sage_grpo.checkpoint import list_checkpoints
    from sage_grpo.cli import quiet_libraries

    quiet_libraries(args.verbose)

    ckpts = list_checkpoints(run)
    if not ckpts:
        raise SageGRPOError(f"--run {args.run!r} holds no complete checkpoint")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stats = learning_stats(run / "metrics.jsonl")

    from sage_grpo.config import load_config, parse_size, torch_dtype
    from sage_grpo.data import read_prompts
    from sage_grpo.generation import sample_stem, sample_videos, write_sample
    from sage_grpo.models.image_cond import ImageConditioningCache
    from sage_grpo.models.loading import load_pipeline
    from sage_grpo.models.lora import load_trained_weights
    from sage_grpo.models.text_cache import TextEmbeddingCache
    from sage_grpo.rewards import build_reward_from_config
    from sage_grpo.rollout import SamplerSettings, latent_shape

    cfg = load_config(["--config", str(run / "config.yaml")])
    m, v = cfg.model, cfg.validation
    dtype = torch_dtype(m.dtype)
    pipe = load_pipeline(m.pretrained_model_root, m.model_path, m.pretrained_transformer_version, dtype=dtype)
    pipe.transformer.requires_grad_(False).eval()
    cache = TextEmbeddingCache(pipe, "cpu", dtype)
    records = read_prompts(cfg.data.train_video_csv)[: args.prompts]
    # an image-to-video run: each prompt's reference image conditions both samples (the same first frame and noise)
    images = ImageConditioningCache(pipe, "cpu", dtype) if pipe.sage_grpo_task == "i2v" else None
    h, w = parse_size(v.validation_fixed_size, "--validation_fixed_size")
    shape = latent_shape(pipe.vae.config, v.validate_video_length, h, w)
    settings = SamplerSettings(sde_type="ode", eta=0.0, num_steps=v.validation_num_inference_steps,
                               shift=v.validation_timestep_shift, cfg_scale=v.validation_guidance_scale,
                               compute_dtype=dtype)
    reward = build_reward_from_config(cfg)
    frames: dict[str, list] = {}
    scores: dict[str, list[float]] = {}
    for tag in ("before", "after"):
        if tag == "after":
            load_trained_weights(pipe.transformer, ckpts[-1][1])
        frames[tag], scores[tag] = [], []
        for rec, video in sample_videos(pipe, cache, records, settings=settings, shape=shape,
                                        base_seed=v.validation_seed, negative_prompt=cfg.rollout.neg_prompt,
                                        images=images):
            score = float(reward(video[None], [rec.prompt])["total"][0])
            write_sample(out / tag / f"{sample_stem(rec)}.mp4", video, prompt=rec.prompt, fps=cfg.rollout.video_fps,
                         meta={"weights": tag, "reward": score})
            frames[tag].append(video)
            scores[tag].append(score)
    strip = out / "strip.png"
    shown = min(args.strip_prompts, len(records))
    _write_strip({k: v[:shown] for k, v in frames.items()}, {k: v[:shown] for k, v in scores.items()},
                 [r.prompt for r in records[:shown]], strip)
    result = {**stats, "reward_before": sum(scores["before"]) / len(records),
              "reward_after": sum(scores["after"]) / len(records), **paired_stats(scores["before"], scores["after"]),
              "checkpoint": str(ckpts[-1][1]), "strip": str(strip)}
    result.update(_world_metrics(frames, [r.prompt for r in records]))
    if images is not None:
        result.update(_first_frame_fidelity(frames, records))
    result.update(hacking_summary(run, ckpts[-1][1]))
    if args.expect:
        result["verdict"] = verdict(args.expect, result["paired_std_errors"])
        result["hacking_expected"] = EXPECTED[args.expect]["hacking"]
    (out / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    if args.expect:
        print(result["verdict"])
        print(f"hacking check: {result['hacking_check']} (measured: {result['hacking_expected']})")
    return result


def _world_metrics(frames: dict, prompts: list[str]) -> dict:
    """On world captions (configs/tiny_world.yaml): on the compared training prompts, the metrics the reward does not
    name (caption attributes, shape fidelity, background, temporal consistency) of the before and after samples,
    the direction share (caption_motion: the object moves the caption's way) and the after samples' distance from
    the before ones (same noise). Empty for other prompts."""
    import torch

    from sage_grpo.errors import SageGRPOError
    from sage_grpo.world import parse_caption
    from sage_grpo.world.metrics import heldout_metrics, reference_distance

    try:
        for p in prompts:
            parse_caption(p)
    except SageGRPOError:
        return {}
    before, after = torch.stack(frames["before"]), torch.stack(frames["after"])
    mean = {tag: {k: round(float(v.mean()), 4) for k, v in heldout_metrics(x, prompts).items()}
            for tag, x in (("before", before), ("after", after))}
    # measured on the compared prompts (training ones), so not "held-out": those are validation's val/<name>
    out = {"unrewarded_before": mean["before"], "unrewarded_after": mean["after"],
           "drift_from_base": round(float(reference_distance(after, before).mean()), 4)}
    # the share of videos whose object moves the caption's way: what the I2V part teaches (world_motion's aim)
    out.update({f"direction_share_{tag}": mean[tag]["caption_motion"] for tag in ("before", "after")})
    return out


def _first_frame_fidelity(frames: dict, records: list) -> dict:
    """Image-to-video runs: the mean first-frame fidelity (1 - RMSE from the reference image, as validation's
    `first_frame_fidelity`) of the before and after samples: the trained reward never sees the image."""
    from sage_grpo.heldout import first_frame_fidelity
    from sage_grpo.models.image_cond import reference_pixels

    out = {}
    for tag, videos in frames.items():
        values = [first_frame_fidelity(v, reference_pixels(r.ref_image_path, v.shape[-2], v.shape[-1]))
                  for v, r in zip(videos, records)]
        out[f"first_frame_fidelity_{tag}"] = round(sum(values) / len(values), 4)
    return out


def _write_strip(frames: dict, scores: dict, prompts: list[str], path: Path) -> None:
    """Rows: prompt x (before, after); columns: 4 frames spread over the video."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, cols = len(prompts), 4
    fig, axes = plt.subplots(2 * n, cols, figsize=(cols * 1.6, 2 * n * 1.75), squeeze=False)
    for i in range(n):
        for j, tag in enumerate(("before", "after")):
            video = frames[tag][i]  # [F, 3, H, W]
            idx = [round(k * (video.shape[0] - 1) / (cols - 1)) for k in range(cols)]
            for c, f in enumerate(idx):
                ax = axes[2 * i + j][c]
                ax.imshow(video[f].permute(1, 2, 0).clamp(0, 1).numpy(), interpolation="nearest")
                ax.set_xticks([])
                ax.set_yticks([])
                if c == 0:
                    ax.set_ylabel(f"{tag}\n{scores[tag][i]:.3f}", fontsize=7)
            if j == 0:  # the whole caption over the row (a caption cut at 40 characters lost its background)
                axes[2 * i][0].set_title(textwrap.fill(prompts[i], 75), fontsize=7, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    run_cli(main)
