#!/usr/bin/env python
"""Ablation grid of the seconds-scale lab: sampler x equalizer x KL variant over seeds, on a CPU.

    python scripts/lab_ablation.py --quick              # 2-D ring, 3 seeds, 30 iterations: a few minutes on 2 cores
    python scripts/lab_ablation.py --seeds 5            # 2-D and 16-D, 5 seeds, 60 iterations
    python scripts/lab_ablation.py --quick --out outputs/lab_quick --workers 2
    python scripts/lab_ablation.py --recipes --seeds 5     # learning per compute of the cheaper-steps recipes

Grid: {dance_grpo, flow_grpo, sage_grpo, cps} x {equalizer off, on} x {KL: none, fixed, stepwise, moving, dual}.
Writes to --out: summary.csv (one row per run), table.csv (mean and std per cell), table_d{D}.md (mean ± std over
seeds), curves.csv (per iteration), steps.csv (per step: noise std, S_t, N_t, measured gradient norms), and PNG
figures (with matplotlib installed, the "plot" extra). Pre-trained base models are cached per (dim, seed) under
--out/base/.

--recipes: instead of that grid, the cheaper-steps recipes of sage_grpo.recipes that apply to the unconditional lab
(paper, window, sliding, sliding_shared: the CFG recipes need a conditional model, and the lab has neither a
higher-order ODE tail nor group timesteps) at sage_grpo, equalizer on, dual KL; recipes.md gives per dimension the
model FLOPs per sample and iteration by phase (rollout / anchor / update, counted in the run) beside the forwards,
their ratio to the paper's recipe (and at 8.3B), the final gains over the base model as mean ± standard error over
seeds, and the recipes at equal drift: each run is evaluated every 5 iterations (drift = RMS distance of its ODE
samples from the base model's on the same noise), and each recipe's curve is read at the paper recipe's final drift
(sage_grpo.lab.equal_drift); equal_drift_d{D}.png draws the curves.

Each grid cell runs single-threaded (tiny MLPs gain nothing from intra-op threads and lose to their
synchronisation) and --workers cells run side by side in spawned processes (--workers 1: in this process).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from sage_grpo.cli import CLIParser, at_least, check_writable_dir
from sage_grpo.errors import run_cli
from sage_grpo.lab import KL_VARIANTS, LAB_SAMPLERS, LabConfig
from sage_grpo.lab.ablation import init_worker, pretrain_job, run_job
from sage_grpo.lab.report import aggregate, draw_figures, format_table, plot_all, write_csv
from sage_grpo.recipes import RECIPES, recipe_settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2-D only, 3 seeds, 30 iterations (under 5 min on 2 cores)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default: 3 with --quick, else 5)")
    p.add_argument("--out", type=Path, default=Path("outputs/lab"), help="output directory (git-ignored outputs/)")
    p.add_argument("--dims", type=int, nargs="+", default=None, help="data dimensions >= 2 (default: 2 quick, 2 16 "
                                                                     "full)")
    p.add_argument("--iterations", type=int, default=None, help="GRPO iterations per run (default: 30 quick, 60)")
    p.add_argument("--samplers", nargs="+", default=list(LAB_SAMPLERS), choices=LAB_SAMPLERS)
    p.add_argument("--kls", nargs="+", default=[k for k in KL_VARIANTS if k != "dual_fixed"], choices=KL_VARIANTS,
                   help="KL variants (default: all but dual_fixed, which differs from dual only in never refreshing "
                   "the anchor)")
    p.add_argument("--recipes", action="store_true", help="the cheaper-steps recipes instead of the sampler x "
                   "equalizer x KL grid")
    p.add_argument("--workers", type=int, default=2, help="cells run in parallel (one thread each)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    args = p.parse_args(argv)
    # `is None`, not `or`: an explicit 0 is an error, never silently the default
    args.seeds = (3 if args.quick else 5) if args.seeds is None else args.seeds
    args.dims = ([2] if args.quick else [2, 16]) if args.dims is None else args.dims
    args.iterations = (30 if args.quick else 60) if args.iterations is None else args.iterations
    at_least("--seeds", args.seeds, 1)
    at_least("--iterations", args.iterations, 1)
    at_least("--workers", args.workers, 1)
    for d in args.dims:
        at_least("--dims", d, 2)  # a ring needs two dimensions
    args.dims = list(dict.fromkeys(args.dims))
    args.samplers, args.kls = list(dict.fromkeys(args.samplers)), list(dict.fromkeys(args.kls))
    return args


def lab_recipe(name: str, num_steps: int) -> dict:
    """A recipe's rollout settings (sage_grpo.recipes) as LabConfig fields."""
    fields = {"sde_window_start": "window_start", "sde_window_size": "window_size",
              "sde_window_stride": "window_stride", "sde_window_every": "window_every", "use_same_noise": "same_noise",
              "shared_prefix": "shared_prefix"}
    # the video loop's keys the lab has no counterpart of, at the values that change nothing: the lab's ODE is its
    # schedule's Euler steps, it trains its own --timestep_fraction, and each sample draws its own steps
    neutral = {"ode_solver": "euler", "ode_steps": 0, "timestep_fraction": 1.0, "group_timesteps": False}
    settings = recipe_settings(name, num_steps)
    for k, v in neutral.items():
        if settings.get(k, v) != v:
            raise ValueError(f"the toy lab cannot run recipe {name!r}: it has no {k} {settings[k]!r}")
    return {fields[k]: v for k, v in settings.items() if k not in neutral}


# (column title, key, decimals) of the lab's recipes table: the final metrics' gains over the base model
RECIPE_COLUMNS = (("Reward gain", "gain_reward", 3), ("Off-manifold change", "gain_off_manifold", 4),
                  ("Mode-entropy change", "gain_mode_entropy", 3))


def _progress(done: int, total: int, t0: float) -> None:
    if done % 20 == 0 or done == total:
        print(f"[lab] {done}/{total} runs ({time.perf_counter() - t0:.0f} s)", flush=True)


def recipe_rows(results: list[dict], names: list[str], iterations: int) -> tuple[list[dict], list[dict]]:
    """The runs of --recipes -> (one summary row per run: the final gains over the base model and the model MFLOP
    per sample and iteration by phase; one row per run and evaluated iteration > 0: its drift from the base model's
    samples and its gains, the points of the equal-drift curves, sage_grpo.lab.equal_drift)."""
    summary, points = [], []
    for res, name in zip(results, names, strict=True):
        row = {**res["summary"], "recipe": name, "steps": iterations}
        for k in ("reward", "off_manifold", "mode_entropy"):
            row[f"gain_{k}"] = row[f"final_{k}"] - row[f"base_{k}"]
        for phase in ("rollout", "anchor", "update"):
            row[f"mflop_{phase}"] = row[f"flop_{phase}_iter"] / 1e6
        row["mflop_step"] = row["flop_iter"] / 1e6
        summary.append(row)
        for h in res["curves"]:
            if h["iteration"] > 0 and "eval/drift" in h:
                points.append({"dim": row["dim"], "recipe": name, "seed": row["seed"], "steps": h["iteration"],
                               "drift": h["eval/drift"], "reward_gain": h["eval/reward"] - row["base_reward"],
                               "heldout_change": h["eval/mode_entropy"] - row["base_mode_entropy"],
                               "off_manifold_change": h["eval/off_manifold"] - row["base_off_manifold"],
                               "mflop_step": row["mflop_step"]})
    return summary, points


def report_recipes(args, out: Path, results: list[dict], names: list[str], recipes: list[str], t0: float) -> int:
    """--recipes: summary.csv, points.csv (every evaluated iteration), recipes.md (per dimension the FLOP table and
    the equal-drift table: each recipe read at the paper recipe's drift after its --iterations, along its
    evaluations every LabConfig.eval_every iterations) and equal_drift_d{D}.png."""
    from sage_grpo.lab.equal_drift import equal_drift
    from sage_grpo.lab.report import format_equal_drift_table, format_flop_table, plot_equal_drift
    from sage_grpo.recipes import RECIPE_FLOP_RATIOS

    summary, points = recipe_rows(results, names, args.iterations)
    write_csv(out / "summary.csv", summary)
    write_csv(out / "points.csv", points)
    seeds = sorted({int(r["seed"]) for r in summary})
    parts, figures = [], []
    for dim in args.dims:
        final = aggregate([r for r in summary if r["dim"] == dim], keys=("dim", "recipe", "steps"))
        pts = [p for p in points if p["dim"] == dim]
        text = (f"D = {dim}: model FLOPs per sample and iteration (matrix products, sage_grpo.lab.model.mlp_flops) and "
                "the final gains over the base model:\n\n"
                + format_flop_table(final, recipes, RECIPE_FLOP_RATIOS, RECIPE_COLUMNS, unit="MFLOP",
                                    step="iteration", forwards_key="forwards_per_sample_iter"))
        results_d = equal_drift(pts, "paper", ref_steps=args.iterations)
        ref = results_d[0]
        text += (f"\n\nD = {dim} at equal drift: each recipe read at the paper recipe's drift {ref['ref_drift']:.4f} "
                 f"and gain {ref['ref_gain']:.3f} (its {args.iterations} iterations), along its curve through the "
                 f"iterations {sorted({int(p['steps']) for p in pts})}, per seed:\n\n"
                 + format_equal_drift_table(results_d, recipes, RECIPE_FLOP_RATIOS,
                                            heldout_title="Mode-entropy change at the paper's drift"))
        parts.append(text)
        if not args.no_plots:
            figures.append((dim, aggregate(pts, keys=("dim", "recipe", "steps")), results_d))
    table = "\n\n".join(parts)
    (out / "recipes.md").write_text(table + "\n")
    print(f"\nLab recipes, mean ± standard error over seeds {seeds}, {args.iterations} iterations (ODE samples of "
          "the policy against the base model's, same noise):\n\n" + table)
    draw_figures("lab", out, lambda: [
        plot_equal_drift(out / f"equal_drift_d{dim}.png", aggs, res, RECIPE_FLOP_RATIOS, unit="MFLOP",
                         step="iteration", y_label="reward gain (ODE samples)", points="iterations",
                         x_label="drift from the base model (RMS distance of ODE samples, same noise)")
        for dim, aggs, res in figures])
    print(f"[lab] total {time.perf_counter() - t0:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    out: Path = check_writable_dir(args.out, "--out")
    seeds = list(range(args.seeds))
    base_cfg = LabConfig(iterations=args.iterations)
    if args.recipes:
        recipes = [r for r in RECIPES if "cfg_scale" not in recipe_settings(r, base_cfg.num_steps)]
        jobs = [(out, dim, replace(base_cfg, seed=seed, **lab_recipe(r, base_cfg.num_steps)))
                for dim in args.dims for seed in seeds for r in recipes]
        names = [r for _dim in args.dims for _seed in seeds for r in recipes]  # each job's recipe
        grid = f"{len(args.dims)} dims x {len(seeds)} seeds x {len(recipes)} recipes"
    else:
        jobs = [
            (out, dim, replace(base_cfg, sampler=s, equalizer=eq, kl=kl, seed=seed))
            for dim in args.dims
            for seed in seeds
            for s in args.samplers
            for eq in (False, True)
            for kl in args.kls
        ]
        grid = f"{len(args.dims)} dims x {len(seeds)} seeds x {len(args.samplers)} samplers x 2 x {len(args.kls)} KL"
    print(f"[lab] {len(jobs)} runs ({grid}), {args.iterations} iterations each, {args.workers} workers -> {out}",
          flush=True)

    pretrain_jobs = [(out, d, s) for d in args.dims for s in seeds]
    results = []
    if args.workers > 1:
        ctx = mp.get_context("spawn")  # no fork after torch has started threads
        with ctx.Pool(args.workers, initializer=init_worker) as pool:
            pool.map(pretrain_job, pretrain_jobs)
            print(f"[lab] base models ready ({time.perf_counter() - t0:.0f} s)", flush=True)
            for r in pool.imap(run_job, jobs):
                results.append(r)
                _progress(len(results), len(jobs), t0)
    else:  # in-process: no start-up cost, easier to debug
        init_worker()
        for job in pretrain_jobs:
            pretrain_job(job)
        for job in jobs:
            results.append(run_job(job))
            _progress(len(results), len(jobs), t0)

    if args.recipes:
        return report_recipes(args, out, results, names, recipes, t0)
    summary = [r["summary"] for r in results]
    curves = [row for r in results for row in r["curves"]]
    steps = [row for r in results for row in r["steps"]]
    write_csv(out / "summary.csv", summary)
    write_csv(out / "curves.csv", curves)
    write_csv(out / "steps.csv", steps)
    aggs = aggregate(summary)
    write_csv(out / "table.csv", aggs)
    for dim in args.dims:
        table = format_table(aggs, args.samplers, args.kls, dim)
        (out / f"table_d{dim}.md").write_text(table + "\n")
        print(f"\nLab table, D = {dim}, mean ± std over {len(seeds)} seeds, {args.iterations} iterations "
              f"(ODE samples of the final policy; grad spread = log10 max/min of the applied per-step norms):")
        print(table)
    if not args.no_plots:
        draw_figures("lab", out, lambda: [p for dim in args.dims for p in plot_all(out, curves, steps, aggs, dim)])
    print(f"[lab] total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
