#!/usr/bin/env python
"""Two rewards that pull apart, combined by the weighted sum or normalised per component: GRPO runs of post_train.py
on the pretrained tiny world model, over seeds, each component's change on a fixed evaluation set.

    python scripts/bench_reward_balance.py                  # 2 combinations x 3 seeds, the config's 40 steps
    python scripts/bench_reward_balance.py --quick          # 1 seed, 1 step, 2 captions: the plumbing only
    python scripts/bench_reward_balance.py --rewards world_size,world_motion --steps 20

Every run is post_train.py's own `main` (in this process) with --config (default configs/tiny_world.yaml), the two
rewards at weight 1 each (--reward_model A,B --reward_weights '{"A":1,"B":1}'), --reward_combine weighted_sum or
component_norm, --seed 0, 1, ... and validation off; it trains on the config's training captions that move left,
right, up or down (`world_motion` cannot score "bounces", which would mask those groups), written to
--out/train_prompts.txt. The default pair: `world_motion` (the object's displacement the caption's way) and
`temporal_consistency` (minus the mean frame-to-frame change): moving further changes the frames more, so they pull
apart, and within a group of the base model's rollouts the first spreads far more widely than the second, so it
alone orders the weighted sums. The script measures both first: the base model's training rollouts of the
evaluation captions (a group of the config's num_generations each, the training sampler and SDE window), each
component's standard deviation within a group and the two components' correlation within a group, averaged over
the groups.

Evaluation: before training (the base weights, once) and after each run (its last checkpoint), the same captions are
sampled by ODE with the config's validation settings, --eval_noises noise seeds each (validation_seed, +1, ...), and
every component is scored; a run's change is its mean over those videos minus the base model's. The table gives
each combination's changes as mean ± standard error over the seeds (and the median), in the component's own units
and in spreads of the base model's scores on the evaluation set, and component_norm - weighted_sum with the standard
error of that difference. Writes --out/summary.json (every run's scores, the within-group spreads and the table's
numbers), --out/table.md and runs/<combine>_s<seed>/ (each run's config.yaml and metrics.jsonl; its checkpoint is
deleted once evaluated). Keep --threads 1 on a shared CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.cli import CLIParser, at_least, check_writable_dir  # noqa: E402
from sage_grpo.errors import SageGRPOError, run_cli  # noqa: E402

COMBINES = ("weighted_sum", "component_norm")
DEFAULT_REWARDS = "world_motion,temporal_consistency"
QUICK = {"seeds": 1, "steps": 1, "eval_prompts": 2, "eval_noises": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 seed, 1 step, 2 evaluation captions, 1 noise each")
    p.add_argument("--rewards", default=DEFAULT_REWARDS,
                   help=f"two registered rewards of one component each, joined by a comma (default: {DEFAULT_REWARDS})")
    p.add_argument("--seeds", type=int, default=None, help="training seeds 0 .. N-1 per combination (default: 3)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default: the config's max_steps)")
    p.add_argument("--eval_prompts", type=int, default=None,
                   help="evaluation captions: the first N training captions (default: all of them)")
    p.add_argument("--eval_noises", type=int, default=None, help="noise seeds per evaluation caption (default: 2)")
    p.add_argument("--config", type=Path, default=Path("configs/tiny_world.yaml"),
                   help="post_train.py config every run starts from (default: configs/tiny_world.yaml)")
    p.add_argument("--out", type=Path, default=Path("outputs/reward_balance"), help="output directory")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (post_train's --threads; default 1)")
    args = check_run_args(p.parse_args(argv), QUICK)
    args.rewards = [r.strip() for r in args.rewards.split(",")]
    if len(args.rewards) != 2 or len(set(args.rewards)) != 2 or not all(args.rewards):
        raise SageGRPOError(f"--rewards takes two different reward names joined by a comma, got {args.rewards}")
    return args


def check_run_args(args: argparse.Namespace, quick: dict) -> argparse.Namespace:
    """The run flags this script and bench_judge_learning.py share: --quick's values (``quick``) where a flag is not
    given, 3 seeds and 2 noises by default, counts >= 1 (one error line otherwise)."""
    for name, value in quick.items():
        if getattr(args, name) is None and args.quick:
            setattr(args, name, value)
    args.seeds = 3 if args.seeds is None else args.seeds
    args.eval_noises = 2 if args.eval_noises is None else args.eval_noises
    at_least("--seeds", args.seeds, 1)
    at_least("--eval_noises", args.eval_noises, 1)
    at_least("--threads", args.threads, 1)
    if args.steps is not None:
        at_least("--steps", args.steps, 1)
    if args.eval_prompts is not None:
        at_least("--eval_prompts", args.eval_prompts, 1)
    return args


def mean_se(values: list[float]) -> dict:
    """Mean, standard error of the mean (sample standard deviation / sqrt(n); NaN for one value) and median."""
    n = len(values)
    se = statistics.stdev(values) / math.sqrt(n) if n >= 2 else math.nan
    return {"mean": statistics.fmean(values), "se": se, "median": statistics.median(values), "n": n}


def difference(a: dict, b: dict) -> dict:
    """b - a of two independent `mean_se` results: the difference of the means, its standard error
    sqrt(se_a^2 + se_b^2) and their ratio."""
    d, se = b["mean"] - a["mean"], math.hypot(a["se"], b["se"])
    return {"diff": d, "se": se, "std_errors": d / se if se > 0 else math.nan}


def aggregate(runs: list[dict], base: dict, components: list[str]) -> dict:
    """runs: {"combine", "seed", "after": {component: mean score}}; base: {component: {"mean", "std"}} of the base
    model on the evaluation set -> per combination and component the change (after - base mean) over the seeds as
    `mean_se`, the same in spreads of the base scores (change / base std), and component_norm - weighted_sum."""
    table: dict = {}
    for combine in dict.fromkeys(r["combine"] for r in runs):
        rows = [r for r in runs if r["combine"] == combine]
        table[combine] = {}
        for k in components:
            change = [r["after"][k] - base[k]["mean"] for r in rows]
            table[combine][k] = {"change": mean_se(change),
                                 "spreads": mean_se([c / base[k]["std"] for c in change]),
                                 "per_seed": {r["seed"]: c for r, c in zip(rows, change)}}
    if all(c in table for c in COMBINES):
        table["component_norm - weighted_sum"] = {
            k: {"change": difference(table["weighted_sum"][k]["change"], table["component_norm"][k]["change"]),
                "spreads": difference(table["weighted_sum"][k]["spreads"], table["component_norm"][k]["spreads"])}
            for k in components}
    return table


def within_group_stats(scores: dict[str, list[float]], group: int) -> dict:
    """scores: {component: [score]}, consecutive runs of `group` videos one group each -> the mean over groups of
    each component's population standard deviation within its group (the spread the group advantage sees) and the
    mean within-group Pearson correlation of the two components over the groups where both vary."""
    a, b = (scores[k] for k in scores)
    groups = [(a[i:i + group], b[i:i + group]) for i in range(0, len(a), group)]
    corr = []
    for x, y in groups:
        sx, sy = statistics.pstdev(x), statistics.pstdev(y)
        if sx > 0 and sy > 0:
            mx, my = statistics.fmean(x), statistics.fmean(y)
            corr.append(statistics.fmean([(u - mx) * (v - my) for u, v in zip(x, y)]) / (sx * sy))
        # a group where one component is constant has no correlation
    return {"std": {k: statistics.fmean(statistics.pstdev(v[i:i + group]) for i in range(0, len(v), group))
                    for k, v in scores.items()},
            "corr": statistics.fmean(corr) if corr else math.nan, "groups": len(groups)}


def format_table(table: dict, base: dict, components: list[str]) -> str:
    """The aggregate as a markdown table (changes: mean ± standard error, median)."""
    lines = ["| combine | component | base | change (mean ± SE) | median | change in base spreads | per seed |",
             "|---|---|---|---|---|---|---|"]
    for combine in COMBINES:
        for k in components if combine in table else ():
            c, s = table[combine][k]["change"], table[combine][k]["spreads"]
            seeds = ", ".join(f"{v:+.4f}" for v in table[combine][k]["per_seed"].values())
            lines.append(f"| {combine} | {k} | {base[k]['mean']:.4f} | {c['mean']:+.4f} ± {c['se']:.4f} | "
                         f"{c['median']:+.4f} | {s['mean']:+.2f} ± {s['se']:.2f} | {seeds} |")
    diff = table.get("component_norm - weighted_sum")
    for k in components if diff else ():
        c, s = diff[k]["change"], diff[k]["spreads"]
        lines.append(f"| component_norm - weighted_sum | {k} | | {c['diff']:+.4f} ± {c['se']:.4f} "
                     f"({c['std_errors']:+.1f} SE) | | {s['diff']:+.2f} ± {s['se']:.2f} | |")
    return "\n".join(lines)


class Evaluator:
    """The base pipeline, loaded once: samples the evaluation captions by ODE (the config's validation settings) with
    the base weights or a run's checkpoint and scores every component."""

    def __init__(self, cfg, records: list, noises: int):
        import torch

        from sage_grpo.config import parse_size
        from sage_grpo.models.loading import load_pipeline
        from sage_grpo.models.text_cache import TextEmbeddingCache
        from sage_grpo.rewards import build_reward_from_config
        from sage_grpo.rollout import SamplerSettings, latent_shape

        m, v = cfg.model, cfg.validation
        # fp32 whatever the stored dtype: CPU sampling, and the trained fp32 master weights load without rounding
        self.pipe = load_pipeline(m.pretrained_model_root, m.model_path, m.pretrained_transformer_version,
                                  dtype=torch.float32)
        self.pipe.transformer.requires_grad_(False).eval()
        self.base_state = {k: t.clone() for k, t in self.pipe.transformer.state_dict().items()}
        self.cache = TextEmbeddingCache(self.pipe, "cpu", torch.float32)
        self.reward = build_reward_from_config(cfg)
        self.records, self.captions = records, [r.prompt for r in records]
        self.neg = cfg.rollout.neg_prompt
        h, w = parse_size(v.validation_fixed_size, "--validation_fixed_size")
        self.shape = latent_shape(self.pipe.vae.config, v.validate_video_length, h, w)
        self.settings = SamplerSettings(sde_type="ode", eta=0.0, num_steps=v.validation_num_inference_steps,
                                        shift=v.validation_timestep_shift, cfg_scale=v.validation_guidance_scale,
                                        compute_dtype=torch.float32)
        self.seeds = [v.validation_seed + j for j in range(noises)]

    def scores(self) -> dict[str, list[float]]:
        """{component: [score of each caption and noise seed]} with the current weights. Each caption gets the noise
        sage_grpo.generation.sample_videos gives its record at that seed, all captions in one batch."""
        import torch

        from sage_grpo.generation import record_noise_seed
        from sage_grpo.rollout import decode_latents, rollout

        recs, n = self.records, len(self.records)
        out: dict[str, list[float]] = {k: [] for k in self.reward.components}
        with torch.no_grad():
            uncond = self.cache.get([self.neg]) if self.settings.use_cfg else None
            for seed in self.seeds:
                traj = rollout(self.pipe.transformer, self.cache.get(self.captions), uncond, prompts=self.captions,
                               prompt_ids=torch.tensor([r.index for r in recs]),
                               generation_ids=torch.zeros(n, dtype=torch.long),
                               prompt_seeds=torch.tensor([record_noise_seed(r) for r in recs]),
                               latent_shape=self.shape, settings=self.settings,
                               image_tokens=self.pipe.vision_num_semantic_tokens, base_seed=seed)
                videos = decode_latents(self.pipe.vae, traj.final_latents).cpu()  # [n, F, 3, H, W]
                scored = self.reward(videos, self.captions)
                for k in out:
                    out[k] += scored[k].double().tolist()
        return out

    def group_scores(self, cfg, group: int) -> dict[str, list[float]]:
        """{component: [score]} of the base model's training rollouts of the evaluation captions: `group` videos a
        caption with the config's sampler, eta, SDE window (its first position) and noise sharing, as a training
        step draws a group (noise seed: the first evaluation seed), the captions' groups one after another."""
        import torch

        from sage_grpo.generation import record_noise_seed
        from sage_grpo.rollout import SamplerSettings, decode_latents, rollout
        from sage_grpo.window import window_masks

        r = cfg.rollout
        settings = replace(SamplerSettings.from_config(cfg), compute_dtype=torch.float32, autocast=False,
                           master_dtype=torch.float32)
        sde = window_masks(r.grpo_sampling_steps, r.sde_window_start, r.sde_window_size, r.sde_window_stride)[0]
        out: dict[str, list[float]] = {k: [] for k in self.reward.components}
        with torch.no_grad():
            uncond = self.cache.get([r.neg_prompt]) if settings.use_cfg else None
            for i in range(0, len(self.records), 8):  # 8 captions x `group` videos a batch
                recs = [rec for rec in self.records[i:i + 8] for _ in range(group)]
                prompts = [rec.prompt for rec in recs]
                traj = rollout(self.pipe.transformer, self.cache.get(prompts), uncond, prompts=prompts,
                               prompt_ids=torch.tensor([rec.index for rec in recs]),
                               generation_ids=torch.arange(group).repeat(len(recs) // group),
                               prompt_seeds=torch.tensor([record_noise_seed(rec) for rec in recs]),
                               latent_shape=self.shape, settings=settings,
                               image_tokens=self.pipe.vision_num_semantic_tokens, base_seed=self.seeds[0],
                               same_noise=r.use_same_noise, sde_steps=sde)
                videos = decode_latents(self.pipe.vae, traj.final_latents).cpu()  # [8 * group, F, 3, H, W]
                scored = self.reward(videos, prompts)
                for k in out:
                    out[k] += scored[k].double().tolist()
        return out

    def trained(self, checkpoint: Path) -> dict[str, list[float]]:
        """`scores` of a run's checkpoint; the base weights are restored after."""
        from sage_grpo.models.lora import load_trained_weights

        load_trained_weights(self.pipe.transformer, checkpoint)
        try:
            return self.scores()
        finally:
            self.pipe.transformer.load_state_dict(self.base_state)


def run_argv(args, run_dir: Path, prompts: Path, combine: str, seed: int) -> list[str]:
    """post_train.py's flags for one run."""
    weights = json.dumps({r: 1.0 for r in args.rewards})
    argv = ["--config", str(args.config), "--output_dir", str(run_dir), "--train_video_csv", str(prompts),
            "--reward_model", ",".join(args.rewards), "--reward_weights", weights, "--reward_combine", combine,
            "--seed", str(seed), "--validation_interval", "0", "--validate_at_step0", "False", "--save_interval", "0",
            "--resume_from_checkpoint", "", "--overwrite_output_dir", "True", "--report_to", "none",
            "--threads", str(args.threads)]
    return argv + (["--max_steps", str(args.steps)] if args.steps is not None else [])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if not args.config.is_file():
        raise SageGRPOError(f"--config {str(args.config)!r} is not a file")
    out: Path = check_writable_dir(args.out, "--out")
    from sage_grpo.config import load_config
    from sage_grpo.data import read_prompts
    from sage_grpo.world.captions import parse_caption

    cfg = load_config(["--config", str(args.config), "--reward_model", ",".join(args.rewards),
                       "--reward_weights", json.dumps({r: 1.0 for r in args.rewards})])
    captions = [r.prompt for r in read_prompts(cfg.data.train_video_csv)
                if parse_caption(r.prompt).motion != "bounces"]
    if not captions:
        raise SageGRPOError(f"{cfg.data.train_video_csv} holds no caption that moves left, right, up or down")
    prompts = out / "train_prompts.txt"
    prompts.write_text("\n".join(captions) + "\n")
    records = read_prompts(prompts)[: args.eval_prompts]
    steps = args.steps if args.steps is not None else cfg.optim.max_steps

    import torch

    import post_train
    from sage_grpo.checkpoint import list_checkpoints
    from sage_grpo.cli import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(args.threads)
    ev = Evaluator(cfg, records, args.eval_noises)
    components = list(ev.reward.components)
    if len(components) != 2:
        raise SageGRPOError(f"--rewards {','.join(args.rewards)} has the components {components}; the comparison "
                            "takes two rewards of one component each")
    base_scores = ev.scores()
    base = {k: {"mean": statistics.fmean(v), "std": statistics.pstdev(v)} for k, v in base_scores.items()}
    group = cfg.data.num_generations
    spreads = within_group_stats(ev.group_scores(cfg, group), group)
    print(f"[reward_balance] {len(COMBINES)} combinations x {args.seeds} seeds, {steps} steps each, rewards "
          f"{components}, {len(captions)} training captions, evaluation {len(records)} captions x "
          f"{args.eval_noises} noises; base " + ", ".join(f"{k} {b['mean']:.4f} (std {b['std']:.4f})"
                                                          for k, b in base.items())
          + f"; within the base model's training groups ({spreads['groups']} captions x {group}): std "
          + ", ".join(f"{k} {v:.4f}" for k, v in spreads["std"].items())
          + f", correlation {spreads['corr']:+.2f}", flush=True)
    runs = []
    for seed in range(args.seeds):
        for combine in COMBINES:
            w0 = time.perf_counter()
            run_dir = out / "runs" / f"{combine}_s{seed}"
            post_train.main(run_argv(args, run_dir, prompts, combine, seed))
            ckpts = list_checkpoints(run_dir)
            if not ckpts or ckpts[-1][0] != steps:
                raise SageGRPOError(f"{run_dir.name} stopped at step {ckpts[-1][0] if ckpts else 0} of {steps} (a "
                                    "stop signal?): the comparison stops")
            w1 = time.perf_counter()
            scores = ev.trained(ckpts[-1][1])
            for _, path in ckpts:
                shutil.rmtree(path)  # tens of MB each; the scores and the run's config and metrics stay
            run = {"combine": combine, "seed": seed, "after": {k: statistics.fmean(v) for k, v in scores.items()},
                   "scores": scores, "train_s": w1 - w0, "eval_s": time.perf_counter() - w1}
            runs.append(run)
            print(f"[reward_balance] {run_dir.name}: " + ", ".join(
                f"{k} {base[k]['mean']:.4f} -> {run['after'][k]:.4f}" for k in components)
                + f" ({run['train_s']:.0f} s training, {run['eval_s']:.0f} s evaluation; total "
                  f"{time.perf_counter() - t0:.0f} s)", flush=True)
    table = aggregate(runs, base, components)
    text = format_table(table, base, components)
    (out / "table.md").write_text(text + "\n")
    summary = {"rewards": args.rewards, "steps": steps, "seeds": list(range(args.seeds)),
               "eval_captions": [r.prompt for r in records], "eval_noise_seeds": ev.seeds, "base": base,
               "group_spreads": spreads,
               "base_scores": base_scores, "runs": runs, "table": table, "total_s": time.perf_counter() - t0}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nEach component's change on the evaluation set ({len(records)} captions x {args.eval_noises} noises, "
          f"ODE), mean ± standard error over {args.seeds} seeds, {steps} GRPO steps per run:")
    print(text)
    print(f"[reward_balance] total {time.perf_counter() - t0:.0f} s -> {out}")
    return summary


if __name__ == "__main__":
    run_cli(main)
