#!/usr/bin/env python
"""Video lab: sampler x KL x equalizer GRPO runs of post_train.py on the pretrained tiny world model, over seeds.

    python scripts/video_ablation.py --quick                 # 16 cells x 1 seed, 6 GRPO steps each
    python scripts/video_ablation.py --seeds 3               # 16 cells x 3 seeds, the config's max_steps
    python scripts/video_ablation.py --quick --samplers sage_grpo flow_grpo --model_path /tmp/world
    python scripts/video_ablation.py --recipes all --seeds 3 --steps 20   # learning per compute of the recipes

Grid: {dance_grpo, flow_grpo, sage_grpo, cps} x {KL: none (--kl_weight 0), dual (--use_dual_kl True
--use_moving_KL True at the config's --kl_weight)} x {equalizer: --use_grad_balancing False / True}. Each cell is
post_train.py's own `main` (in this process) with --config (default configs/tiny_world.yaml) and those flags, its
--seed the lab seed, its validation off. After a cell, the held-out captions of the config (valid_video_csv) are
sampled by ODE with the config's validation settings and the run's last checkpoint, noise seed validation_seed +
lab seed, and scored: the trained reward (the config's), the held-out metrics of sage_grpo.world.metrics and the drift
(RMSE from the base model's samples of the same captions and noise, sampled once per seed and cached under
--out/base/). The reward curve comes from the run's metrics.jsonl.

--recipes: instead of that grid, the cheaper-steps recipes of sage_grpo.recipes (paper, cfg_free, window, sliding,
sliding_shared, cfg_free_sliding) at the config's sampler, KL and equalizer, over seeds; the table (recipes.md) adds
each recipe's per-sample transformer forwards per step (sage_grpo.recipes.minimum_forwards, which the step benchmark
checks against the loop's counted forwards) and gives mean ± standard error over seeds.

Writes to --out: summary.csv (one row per run), curves.csv (rollout reward per step), table.csv (mean and std per
cell), table.md (mean ± standard error over seeds, with the seed count), stability_plasticity.png (error bars:
standard errors) and reward_curves.png (the "plot" extra), and
runs/<cell>/ (each run's config.yaml and metrics.jsonl; its checkpoint is deleted once evaluated).

Timing (--threads 1, the stand-in model /work/scratch/trial0 of the same architecture): one --quick cell (sage_grpo,
equalizer on, dual KL, 6 steps) took 50 CPU seconds (47.5 for post_train.py's run with its model load, prompt
encoding and checkpoint, and the base model's samples, drawn with the first cell; 2.7 for the evaluation), i.e.
about 50 s of wall time on a quiet core; so the 16 cells of --quick are estimated at ~13 min on a quiet 2-core
machine (KL-none cells skip the anchor and cost less). Measured on a machine under load 9-13 (a priority pretraining
job and other agents' tests on the 2 cores): 504 s wall for that cell.
Under load keep --threads 1: two threads spin at OpenMP barriers when a core is taken away.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.cli import CLIParser, at_least, check_writable_dir  # noqa: E402
from sage_grpo.errors import SageGRPOError, run_cli  # noqa: E402
from sage_grpo.lab.video import VIDEO_KLS, VIDEO_SAMPLERS  # noqa: E402
from sage_grpo.recipes import RECIPES  # noqa: E402
from sage_grpo.world.pretrain import WORLD_MODEL_DIR  # noqa: E402

QUICK_STEPS = 6  # GRPO steps per run in --quick (the full mode runs the config's max_steps)
EQUALIZER = {"off": False, "on": True}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"1 seed, {QUICK_STEPS} steps per run")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default: 1 with --quick, else 3)")
    p.add_argument("--seed_start", type=int, default=0,
                   help="first lab seed (seeds seed_start .. seed_start + seeds - 1): share one --out between "
                        "calls, each taking its own seeds; the table covers the seeds of this call")
    p.add_argument("--steps", type=int, default=None,
                   help=f"GRPO steps per run (default: {QUICK_STEPS} with --quick, else the config's max_steps)")
    p.add_argument("--samplers", nargs="+", default=list(VIDEO_SAMPLERS), choices=VIDEO_SAMPLERS)
    p.add_argument("--kls", nargs="+", default=list(VIDEO_KLS), choices=VIDEO_KLS)
    p.add_argument("--equalizer", nargs="+", default=list(EQUALIZER), choices=tuple(EQUALIZER))
    p.add_argument("--recipes", nargs="+", default=None, choices=(*RECIPES, "all"),
                   help="run these cheaper-steps recipes (all = every one) at the config's sampler, KL and equalizer "
                        "instead of the sampler x KL x equalizer grid")
    p.add_argument("--config", type=Path, default=Path("configs/tiny_world.yaml"),
                   help="post_train.py config every run starts from (default: configs/tiny_world.yaml)")
    p.add_argument("--model_path", default=WORLD_MODEL_DIR, help=f"diffusers-layout model (default: {WORLD_MODEL_DIR})")
    p.add_argument("--out", type=Path, default=Path("outputs/video_lab"), help="output directory")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (post_train's --threads; default 1: the timing in docs/labs.md)")
    p.add_argument("--eval_every", type=int, default=0,
                   help="with --recipes: also evaluate the checkpoints every this many steps (post_train's "
                        "--save_interval), one table row per recipe and evaluated step: the curve of reward gain "
                        "against drift through the run's steps (the equal-drift comparison); 0 = the last step only")
    p.add_argument("--report_only", action="store_true",
                   help="run nothing: the tables and figures of the runs --out holds already (runs not there yet are "
                        "left out and named)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    args = p.parse_args(argv)
    args.seeds = (1 if args.quick else 3) if args.seeds is None else args.seeds
    args.steps = (QUICK_STEPS if args.quick else None) if args.steps is None else args.steps
    at_least("--seeds", args.seeds, 1)
    if args.steps is not None:
        at_least("--steps", args.steps, 1)
    at_least("--threads", args.threads, 1)
    at_least("--eval_every", args.eval_every, 0)
    at_least("--seed_start", args.seed_start, 0)
    if args.eval_every and not args.recipes:
        raise SageGRPOError("--eval_every needs --recipes (the grid evaluates each run's last step)")
    args.samplers, args.kls = list(dict.fromkeys(args.samplers)), list(dict.fromkeys(args.kls))
    args.equalizer = [EQUALIZER[e] for e in dict.fromkeys(args.equalizer)]
    if args.recipes is not None:
        args.recipes = list(RECIPES) if "all" in args.recipes else list(dict.fromkeys(args.recipes))
    return args


def _post_train():
    """post_train.py as a module (the repository root is on sys.path; the tests may have loaded it already)."""
    import post_train

    return post_train


def _fingerprint(model_path: str) -> str:
    """Names, sizes and modification times of the model's files: a retrained model at the same path gets new base
    samples instead of stale cached ones."""
    h = hashlib.sha256()
    for f in sorted(Path(model_path).rglob("*")):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.relative_to(model_path)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


class Evaluator:
    """The base model's pipeline, loaded once: samples the held-out captions with the base weights (cached) or a
    run's checkpoint, and scores them."""

    def __init__(self, cfg, model_path: str, records: list, out: Path):
        import torch

        from sage_grpo.config import parse_size
        from sage_grpo.models.loading import load_pipeline
        from sage_grpo.models.text_cache import TextEmbeddingCache
        from sage_grpo.rewards import build_reward_from_config
        from sage_grpo.rollout import SamplerSettings, latent_shape

        v = cfg.validation
        # fp32 whatever the stored dtype: CPU sampling, and the trained fp32 master weights load without rounding
        self.pipe = load_pipeline("", model_path, dtype=torch.float32)
        self.pipe.transformer.requires_grad_(False).eval()
        self.base_state = {k: t.clone() for k, t in self.pipe.transformer.state_dict().items()}
        self.cache = TextEmbeddingCache(self.pipe, "cpu", torch.float32)
        self.reward = build_reward_from_config(cfg)
        self.records, self.captions = records, [r.prompt for r in records]
        self.out, self.neg = out, cfg.rollout.neg_prompt
        h, w = parse_size(v.validation_fixed_size, "--validation_fixed_size")
        self.shape = latent_shape(self.pipe.vae.config, v.validate_video_length, h, w)
        self.settings = SamplerSettings(sde_type="ode", eta=0.0, num_steps=v.validation_num_inference_steps,
                                        shift=v.validation_timestep_shift, cfg_scale=v.validation_guidance_scale,
                                        compute_dtype=torch.float32)
        self.seed0 = v.validation_seed
        self.meta = {"model": _fingerprint(model_path), "records": [[r.prompt, r.seed, r.index] for r in records],
                     "shape": list(self.shape),
                     "steps": v.validation_num_inference_steps, "shift": v.validation_timestep_shift,
                     "cfg": v.validation_guidance_scale, "neg": self.neg}
        self._base: dict[int, tuple] = {}

    def sample(self, seed: int):
        """ODE videos [B, F, 3, H, W] in [0, 1] of the held-out captions with the current weights, each with the
        noise sage_grpo.generation.sample_videos (validation, generate.py) gives its record, but all captions in one
        batch (several times faster on a CPU than one at a time)."""
        import torch

        from sage_grpo.generation import record_noise_seed
        from sage_grpo.rollout import decode_latents, rollout

        n, recs = len(self.records), self.records
        with torch.no_grad():
            uncond = self.cache.get([self.neg]) if self.settings.use_cfg else None
            traj = rollout(self.pipe.transformer, self.cache.get(self.captions), uncond, prompts=self.captions,
                           prompt_ids=torch.tensor([r.index for r in recs]),
                           generation_ids=torch.zeros(n, dtype=torch.long),
                           prompt_seeds=torch.tensor([record_noise_seed(r) for r in recs]),
                           latent_shape=self.shape, settings=self.settings,
                           image_tokens=self.pipe.vision_num_semantic_tokens, base_seed=self.seed0 + seed)
            return decode_latents(self.pipe.vae, traj.final_latents).cpu()

    def score(self, videos, references=None) -> tuple:
        from sage_grpo.world.metrics import heldout_metrics

        reward = self.reward(videos, self.captions)["total"].float().cpu()
        return reward, heldout_metrics(videos, self.captions, references)

    def base(self, seed: int) -> tuple:
        """(videos, reward, metrics) of the base model for a seed: from --out/base/ when its settings match."""
        import torch

        if seed not in self._base:
            path = self.out / "base" / f"base_s{seed}.pt"
            meta = json.dumps({**self.meta, "seed": seed}, sort_keys=True)
            videos = None
            if path.is_file():
                blob = torch.load(path, map_location="cpu", weights_only=True)
                if blob["meta"] == meta:
                    videos = blob["videos"]
            if videos is None:
                videos = self.sample(seed)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                torch.save({"meta": meta, "videos": videos}, tmp)
                tmp.replace(path)  # atomic: an interrupted write never leaves a half file that looks cached
            self._base[seed] = (videos, *self.score(videos))
        return self._base[seed]

    def trained(self, checkpoint: Path, seed: int) -> tuple:
        """(reward, metrics with reference_distance) of a run's checkpoint; the base weights are restored after."""
        from sage_grpo.models.lora import load_trained_weights

        base_videos = self.base(seed)[0]
        load_trained_weights(self.pipe.transformer, checkpoint)
        try:
            return self.score(self.sample(seed), base_videos)
        finally:
            self.pipe.transformer.load_state_dict(self.base_state)


def run_cell(args, name: str, flags: list[str], seed: int, out: Path) -> Path:
    """One post_train.py run (the config with `flags`) -> its output_dir (config.yaml, metrics.jsonl, the final
    checkpoint)."""
    run_dir = out / "runs" / name
    _post_train().main(run_argv(args, run_dir, flags, seed))
    return run_dir


def run_argv(args, run_dir: Path, flags: list[str], seed: int) -> list[str]:
    argv = ["--config", str(args.config), "--model_path", str(args.model_path), "--output_dir", str(run_dir),
            "--seed", str(seed), "--validation_interval", "0", "--validate_at_step0", "False",
            "--save_interval", str(getattr(args, "eval_every", 0)),
            "--resume_from_checkpoint", "", "--overwrite_output_dir", "True", "--report_to", "none",
            "--threads", str(args.threads), *flags]
    if args.steps is not None:
        argv += ["--max_steps", str(args.steps)]
    return argv


RESULT_FILE = "result.json"  # a run's evaluated rows and reward curve, with the argv that made them


def _settings(argv: list[str]) -> dict:
    """The resolved post_train.py settings of a run's argv, but for how long it ran and where (the launch keys:
    --out may be given by another path): what makes its steps."""
    from sage_grpo.config import LAUNCH_KEYS, config_to_dict, load_config

    out = config_to_dict(load_config(argv))
    out["optim"].pop("max_steps")
    return {g: {k: v for k, v in values.items() if k not in LAUNCH_KEYS} for g, values in out.items()}


def read_result(run_dir: Path, argv: list[str], steps: int) -> dict | None:
    """The rows and curves, up to step `steps`, of a run evaluated before with the same resolved settings (flags
    in any order, a recipe key this version adds at its default) and at least `steps` steps, else None. A run of
    more steps covers a shorter one: the schedule of the world config has no dependence on max_steps (a constant
    learning rate and KL coefficient), so its checkpoint at step s is the s-step run."""
    path = run_dir / RESULT_FILE
    if not path.is_file():
        return None
    blob = json.loads(path.read_text())
    rows = [r for r in blob["rows"] if r["steps"] <= steps]
    if _settings(blob["argv"]) != _settings(argv) or not rows or rows[-1]["steps"] != steps:
        return None
    return {"rows": rows, "curves": [c for c in blob["curves"] if c["step"] <= steps]}


def write_result(run_dir: Path, argv: list[str], rows: list[dict], curves: list[dict]) -> None:
    tmp = run_dir / (RESULT_FILE + ".tmp")
    tmp.write_text(json.dumps({"argv": argv, "rows": rows, "curves": curves}))
    tmp.replace(run_dir / RESULT_FILE)  # atomic: a half-written result is never taken for a finished run


def step_flops(metrics_path: Path, up_to: int, batch_size: int) -> dict:
    """Mean model FLOPs per sample and step of the run's steps 1..up_to, by phase, from the loop's own FLOP meter
    (metrics.jsonl's perf/<phase>_tflop): {"gflop_rollout", "gflop_anchor", "gflop_update", "gflop_step"}."""
    sums, n = {}, 0
    for line in Path(metrics_path).read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "perf/step_tflop" not in rec or int(rec["step"]) > up_to:
            continue
        n += 1
        for phase in ("rollout", "anchor", "update", "step"):
            sums[phase] = sums.get(phase, 0.0) + float(rec.get(f"perf/{phase}_tflop", 0.0))
    if n == 0:
        raise SageGRPOError(f"{metrics_path} has no perf/step_tflop record up to step {up_to}")
    return {f"gflop_{k}": v / n * 1e3 / batch_size for k, v in sums.items()}


def report_recipes(args, out: Path, rows: list[dict], curves: list[dict], steps: int, captions: int,
                   t0: float) -> int:
    """The recipes' tables and figure: table.csv (mean and std per recipe and evaluated step), recipes.md (the FLOP
    table at the last step; with --eval_every, the equal-drift table: sage_grpo.lab.equal_drift) and equal_drift.png."""
    from sage_grpo.lab.equal_drift import equal_drift
    from sage_grpo.lab.report import aggregate, draw_figures, write_csv
    from sage_grpo.lab.video import format_equal_drift_table, format_flop_table, plot_equal_drift
    from sage_grpo.recipes import RECIPE_FLOP_RATIOS

    aggs = aggregate(rows, keys=("recipe", "steps"))
    write_csv(out / "table.csv", aggs)
    final = [a for a in aggs if a["steps"] == steps]
    seeds = sorted({int(r["seed"]) for r in rows})
    text = (f"Recipes, mean ± standard error over seeds {seeds}, {steps} GRPO steps per run, {captions} held-out "
            "captions (ODE); gains and drift against the base model on the same noise; FLOPs from the loop's meter:\n\n"
            + format_flop_table(final, args.recipes, RECIPE_FLOP_RATIOS) + "\n")
    results = []
    if args.eval_every and any(r["recipe"] == "paper" for r in rows):  # the reference point: the paper's runs
        results = equal_drift(rows, "paper", ref_steps=steps)
        ref = results[0]
        text += (f"\nAt equal drift: each recipe read at the paper recipe's drift {ref['ref_drift']:.4f} and gain "
                 f"{ref['ref_gain']:.3f} (its {steps} steps), along its curve through the steps "
                 f"{sorted({int(r['steps']) for r in rows})}, per seed:\n\n"
                 + format_equal_drift_table(results, args.recipes, RECIPE_FLOP_RATIOS) + "\n")
    (out / "recipes.md").write_text(text)
    print("\n" + text)
    if not args.no_plots and args.eval_every:
        draw_figures("video_lab", out, lambda: [plot_equal_drift(out, aggs, results, RECIPE_FLOP_RATIOS)])
    print(f"[video_lab] total {time.perf_counter() - t0:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    out: Path = check_writable_dir(args.out, "--out")
    if not args.config.is_file():
        raise SageGRPOError(f"--config {str(args.config)!r} is not a file")
    from sage_grpo.config import load_config
    from sage_grpo.data import PromptRecord, read_prompts
    from sage_grpo.models.loading import locate_model
    from sage_grpo.world.captions import parse_caption

    locate_model("", args.model_path)  # a missing model is one line, before anything loads
    cfg = load_config(["--config", str(args.config), "--model_path", str(args.model_path)])
    if "dual" in args.kls and not cfg.kl.kl_weight > 0:
        raise SageGRPOError(f"KL 'dual' needs kl_weight > 0 in --config {args.config}, which has {cfg.kl.kl_weight}")
    v = cfg.validation
    records = (read_prompts(v.valid_video_csv) if v.valid_video_csv
               else [PromptRecord(prompt=p, index=i) for i, p in enumerate(v.validation_prompts)])
    if not records:
        raise SageGRPOError(f"--config {args.config} names no held-out captions (valid_video_csv or "
                            "validation_prompts): the lab scores them")
    for r in records:
        parse_caption(r.prompt)  # a caption the world's detectors cannot read fails here, before any run
    steps = args.steps if args.steps is not None else cfg.optim.max_steps

    import torch

    from sage_grpo.checkpoint import list_checkpoints
    from sage_grpo.cli import quiet_libraries
    from sage_grpo.lab.report import draw_figures, write_csv
    from sage_grpo.lab.video import (
        aggregate_runs,
        cell_flags,
        cell_name,
        format_video_table,
        plot_video_lab,
        reward_curve,
        run_row,
    )
    from sage_grpo.recipes import forwards_per_sample_step, recipe_flags

    quiet_libraries()
    torch.set_num_threads(args.threads)
    seeds = range(args.seed_start, args.seed_start + args.seeds)
    if args.recipes:
        jobs = [({"recipe": r, "seed": seed, "steps": steps}, f"{r}_s{seed}",
                 recipe_flags(r, cfg.rollout.grpo_sampling_steps)) for seed in seeds for r in args.recipes]
        grid = f"{args.seeds} seeds x {len(args.recipes)} recipes"
    else:
        jobs = [({"sampler": s, "equalizer": eq, "kl": kl, "seed": seed, "steps": steps},
                 cell_name(s, kl, eq, seed), cell_flags(s, kl, eq, cfg.kl.kl_weight))
                for seed in seeds for s in args.samplers for eq in args.equalizer for kl in args.kls]
        grid = (f"{args.seeds} seeds x {len(args.samplers)} samplers x {len(args.equalizer)} equalizer x "
                f"{len(args.kls)} KL")
    print(f"[video_lab] {len(jobs)} runs ({grid}), {steps} steps each, {len(records)} held-out "
          f"captions, model {args.model_path} -> {out}", flush=True)
    ev = Evaluator(cfg, args.model_path, records, out)
    rows, curves = [], []
    for i, (tag, name, flags) in enumerate(jobs):
        seed, run_dir = tag["seed"], out / "runs" / name
        argv_run = run_argv(args, run_dir, flags, seed)
        done = read_result(run_dir, argv_run, steps)
        if done is not None:  # evaluated by an earlier call with the same flags: --out collects runs across calls
            rows += done["rows"]
            curves += done["curves"]
            print(f"[video_lab] {i + 1}/{len(jobs)} {name}: evaluated before ({RESULT_FILE})", flush=True)
            continue
        if args.report_only:
            print(f"[video_lab] {i + 1}/{len(jobs)} {name}: not run yet, left out (--report_only)", flush=True)
            continue
        c0, w0 = time.process_time(), time.perf_counter()
        _, base_reward, base_metrics = ev.base(seed)  # first use: sampled and timed with the first cell
        run_cell(args, name, flags, seed, out)
        c1, w1 = time.process_time(), time.perf_counter()
        ckpts = list_checkpoints(run_dir)
        if not ckpts or ckpts[-1][0] != steps:
            raise SageGRPOError(f"{run_dir.name} stopped at step {ckpts[-1][0] if ckpts else 0} of {steps} (a stop "
                                "signal?): the lab stops")
        curve = reward_curve(run_dir / "metrics.jsonl")
        run_rows = []
        for step, path in ckpts if args.eval_every else ckpts[-1:]:
            reward, metrics = ev.trained(path, seed)
            row = run_row({**tag, "steps": step}, reward=reward, base_reward=base_reward, metrics=metrics,
                          base_metrics=base_metrics, curve=[(s, r) for s, r in curve if s <= step])
            if args.recipes:  # the transformer work of the run's own configuration up to this step
                row["forwards_per_step"] = forwards_per_sample_step(load_config(argv_run), step)
                row.update(step_flops(run_dir / "metrics.jsonl", step, cfg.data.batch_size))
            run_rows.append(row)
        t_train, t_eval = w1 - w0, time.perf_counter() - w1
        for row in run_rows:
            row.update(train_s=t_train, train_cpu_s=c1 - c0, eval_s=t_eval, eval_cpu_s=time.process_time() - c1)
        run_curves = [{**tag, "step": s, "reward": r} for s, r in curve]
        write_result(run_dir, argv_run, run_rows, run_curves)
        rows += run_rows
        curves += run_curves
        for _, path in ckpts:
            shutil.rmtree(path)  # tens of MB each; the rows, the curve and the run's config stay
        last = run_rows[-1]
        print(f"[video_lab] {i + 1}/{len(jobs)} {run_dir.name}: reward gain {last['reward_gain']:+.3f}, drift "
              f"{last['drift']:.4f} ({t_train + t_eval:.0f} s; total {time.perf_counter() - t0:.0f} s)", flush=True)

    if not rows:  # only --report_only gets here without rows: every other path ran its jobs
        raise SageGRPOError(f"--report_only: {out} holds no finished run of these recipes and seeds; run the same "
                            "command without --report_only first")
    write_csv(out / "summary.csv", rows)
    write_csv(out / "curves.csv", curves)
    if args.recipes:
        return report_recipes(args, out, rows, curves, steps, len(records), t0)
    aggs = aggregate_runs(rows)
    write_csv(out / "table.csv", aggs)
    table = format_video_table(aggs, args.samplers, args.kls)
    (out / "table.md").write_text(table + "\n")
    print(f"\nVideo lab, mean ± standard error over {args.seeds} seeds, {steps} GRPO steps per run, {len(records)} "
          "held-out captions (ODE); gains and drift against the base model on the same noise:")
    print(table)
    if not args.no_plots:
        draw_figures("video_lab", out, lambda: plot_video_lab(out, rows, aggs, curves))
    print(f"[video_lab] total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
