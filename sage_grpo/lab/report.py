"""Aggregation of lab runs into a Table-2-shaped table, CSV writing, and figures (matplotlib imported lazily).

Nothing here knows what the numbers "should" be: the table is whatever the runs produced, mean +- std over seeds.
"""

from __future__ import annotations

import csv
import math
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

__all__ = ["TABLE_METRICS", "aggregate", "format_table", "write_csv", "plot_all", "save_figure", "draw_figures",
           "standard_error", "mean_se_cell", "format_flop_table", "format_equal_drift_table",
           "plot_equal_drift"]

# (column title, summary key, decimals). Off-manifold: lower is better; the others: see docs/labs.md.
TABLE_METRICS = (
    ("Reward", "final_reward", 3),
    ("Off-manifold", "final_off_manifold", 3),
    ("Coverage", "final_mode_coverage", 2),
    ("Entropy", "final_mode_entropy", 3),
    ("Grad spread", "grad_spread_applied", 2),
)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0  # sample std over seeds
    return mean, std


def aggregate(rows: Iterable[dict], keys: Sequence[str] = ("dim", "sampler", "equalizer", "kl")) -> list[dict]:
    """Group per-run summary rows by `keys` -> one row per group with `<metric>_mean`, `<metric>_std`, `n`.

    Also adds the base model's metrics (same for every cell of a seed) and, for rows that carry gradient spreads (the
    toy lab), `grad_spread_applied`: the spread of the per-step gradient norms that the run actually applied
    (equalized if its equalizer is on, raw otherwise).
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        r = dict(r)
        if "grad_spread_eq" in r:  # toy-lab rows only: the video lab measures no per-step gradient norms
            r["grad_spread_applied"] = r["grad_spread_eq"] if _truthy(r["equalizer"]) else r["grad_spread_raw"]
        groups[tuple(r[k] for k in keys)].append(r)
    out = []
    for key, members in groups.items():
        agg = dict(zip(keys, key))
        agg["n"] = len(members)
        numeric = [k for k, v in members[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        for k in numeric:
            if k in keys or k == "seed":
                continue
            agg[f"{k}_mean"], agg[f"{k}_std"] = _mean_std([float(m[k]) for m in members])
        out.append(agg)
    return out


def _truthy(v) -> bool:
    return v is True or str(v).lower() in ("true", "1", "on")


def _cell(agg: dict, key: str, decimals: int) -> str:
    return f"{agg[f'{key}_mean']:.{decimals}f} ± {agg[f'{key}_std']:.{decimals}f}"


def standard_error(agg: Mapping, key: str) -> float:
    """The standard error of a cell's mean over its `n` seeds: the sample std over seeds / sqrt(n) (0 for one seed:
    no spread measured, which the table's seed count says)."""
    return float(agg[f"{key}_std"]) / float(agg["n"]) ** 0.5


def mean_se_cell(agg: Mapping, key: str, decimals: int) -> str:
    """`<mean> ± <standard error>` of a cell's `key` over its `n` seeds; the mean alone for one seed, where no spread
    was measured (a "± 0.000" would read as a certain value)."""
    mean = float(agg[f"{key}_mean"])
    if int(agg["n"]) < 2:
        return f"{mean:.{decimals}f}"
    return f"{mean:.{decimals}f} ± {standard_error(agg, key):.{decimals}f}"


def format_table(aggs: list[dict], samplers: Sequence[str], kls: Sequence[str], dim: int) -> str:
    """Markdown table in the shape of the paper's Table 2: the base model first, then sampler x KL x equalizer."""
    cells = {(a["sampler"], _truthy(a["equalizer"]), a["kl"]): a for a in aggs if int(a["dim"]) == dim}
    if not cells:
        return ""
    head = ["Method", "Equalizer", "KL"] + [t for t, _, _ in TABLE_METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    any_cell = next(iter(cells.values()))
    base = [
        _cell(any_cell, f"base_{k[len('final_'):]}", d) if k.startswith("final_") else "-" for _, k, d in TABLE_METRICS
    ]
    lines.append("| Pre-trained flow | - | - | " + " | ".join(base) + " |")
    for sampler in samplers:
        for eq in (False, True):
            for kl in kls:
                a = cells.get((sampler, eq, kl))
                if a is None:
                    continue
                vals = [_cell(a, k, d) for _, k, d in TABLE_METRICS]
                lines.append(f"| {sampler} | {'on' if eq else 'off'} | {kl} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict]) -> None:
    """Rows with possibly different keys -> one CSV whose header is the union of keys (first-seen order)."""
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def plot_all(out_dir: Path, curves: list[dict], steps: list[dict], aggs: list[dict], dim: int) -> list[Path]:
    """Figures for one data dimension -> paths written.

    curves: rows {dim, sampler, equalizer, kl, seed, iteration, eval/reward, eval/off_manifold}; steps: rows
    {dim, sampler, seed, step, sigma, noise_std, equalizer_weight, predicted_scale, grad_norm_start}.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    samplers = sorted({r["sampler"] for r in curves if r["dim"] == dim})
    kls = list(dict.fromkeys(r["kl"] for r in curves if r["dim"] == dim))
    colors = {kl: f"C{i}" for i, kl in enumerate(kls)}

    # 1. eval reward and off-manifold distance vs iteration (mean over seeds); solid = equalizer on.
    for metric, fname in (("eval/reward", "reward_curves"), ("eval/off_manifold", "off_manifold_curves")):
        fig, axes = plt.subplots(1, len(samplers), figsize=(4 * len(samplers), 3.4), sharey=True, squeeze=False)
        for ax, sampler in zip(axes[0], samplers):
            for kl in kls:
                for eq in (True, False):
                    by_it: dict[int, list[float]] = defaultdict(list)
                    for r in curves:
                        if (r["dim"], r["sampler"], r["kl"], r["equalizer"]) == (dim, sampler, kl, eq) and metric in r:
                            by_it[r["iteration"]].append(r[metric])
                    if by_it:
                        its = sorted(by_it)
                        ax.plot(its, [sum(by_it[i]) / len(by_it[i]) for i in its], color=colors[kl],
                                linestyle="-" if eq else "--", label=f"{kl} ({'eq' if eq else 'no eq'})")
            ax.set_title(f"{sampler} (D={dim})")
            ax.set_xlabel("iteration")
        axes[0][0].set_ylabel(metric.split("/")[1])
        axes[0][-1].legend(fontsize=6, ncol=2)
        fig.tight_layout()
        written.append(save_figure(fig, out_dir / f"{fname}_d{dim}.png", plt))

    # 2. Fig. 3-4: measured per-step gradient norms (base model, mean over seeds) raw vs equalized, and N_t.
    fig, axes = plt.subplots(1, len(samplers), figsize=(4 * len(samplers), 3.4), squeeze=False)
    for ax, sampler in zip(axes[0], samplers):
        rows = [r for r in steps if r["dim"] == dim and r["sampler"] == sampler]
        by_step: dict[int, list[dict]] = defaultdict(list)
        for r in rows:
            by_step[r["step"]].append(r)
        ts = [t for t in sorted(by_step) if by_step[t][0]["noise_std"] > 0]
        raw = [sum(r["grad_norm_start"] for r in by_step[t]) / len(by_step[t]) for t in ts]
        eq = [g * by_step[t][0]["equalizer_weight"] for g, t in zip(raw, ts)]
        pred = [by_step[t][0]["predicted_scale"] for t in ts]
        k = sorted(raw)[len(raw) // 2] / max(sorted(pred)[len(pred) // 2], 1e-12)  # match medians for display
        ax.semilogy(ts, raw, "o-", label="measured, no equalizer")
        ax.semilogy(ts, eq, "s-", label="measured x S_t")
        ax.semilogy(ts, [k * p for p in pred], "r--", label="predicted N_t (scaled)")
        ax.set_title(f"{sampler} (D={dim})")
        ax.set_xlabel("step t (sigma 1 -> 0)")
    axes[0][0].set_ylabel("||grad log pi|| per step")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    written.append(save_figure(fig, out_dir / f"grad_norms_d{dim}.png", plt))

    # 3. gradient-norm spread per cell (orders of magnitude), mean over seeds.
    fig, ax = plt.subplots(figsize=(1.2 * len(samplers) + 2, 3.4))
    for j, (key, label) in enumerate((("grad_spread_raw", "no equalizer"), ("grad_spread_eq", "equalizer"))):
        vals = []
        for sampler in samplers:
            a = [x for x in aggs if int(x["dim"]) == dim and x["sampler"] == sampler]
            vals.append(sum(x[f"{key}_mean"] for x in a) / len(a))
        ax.bar([i + 0.4 * j for i in range(len(samplers))], vals, width=0.4, label=label)
    ax.set_xticks([i + 0.2 for i in range(len(samplers))], samplers)
    ax.set_ylabel("log10(max/min) per-step grad norm")
    ax.legend()
    fig.tight_layout()
    written.append(save_figure(fig, out_dir / f"grad_spread_d{dim}.png", plt))

    # 4. Fig. 9: injected noise std per step.
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for sampler in samplers:
        rows = sorted({r["step"]: r for r in steps if r["dim"] == dim and r["sampler"] == sampler}.values(),
                      key=lambda r: r["step"])
        ax.plot([r["step"] for r in rows], [r["noise_std"] for r in rows], "o-", ms=3, label=sampler)
    ax.set_xlabel("step t (sigma 1 -> 0)")
    ax.set_ylabel("noise std sqrt(V_t)")
    ax.legend()
    fig.tight_layout()
    written.append(save_figure(fig, out_dir / "noise_std.png", plt))
    return written


def save_figure(fig, path: Path, plt) -> Path:
    """Write `fig` as a PNG (parents created) and close it; the toy lab's and the video lab's figures."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_figures(tag: str, out: Path, draw: Callable[[], Iterable[Path]]) -> list[Path]:
    """Run `draw` (it imports matplotlib) and print the names of the figures it wrote; without matplotlib, one note
    on stderr and no figures (the tables and CSVs do not need it). `tag`: the script's log prefix."""
    try:
        paths = list(draw())
    except ImportError:
        print(f"[{tag}] matplotlib missing (pip install '.[plot]'): no figures", file=sys.stderr)
        return []
    print(f"\n[{tag}] figures in {out}: {', '.join(sorted({p.name for p in paths}))}")
    return paths


def _pm(mean_se: tuple[float, float], decimals: int) -> str:
    mean, se = mean_se
    return f"{mean:.{decimals}f}" if se != se else f"{mean:.{decimals}f} ± {se:.{decimals}f}"  # se NaN: one seed


def format_flop_table(aggs: Sequence[dict], recipes: Sequence[str], real_ratios: Mapping[str, float],
                      columns: Sequence[tuple[str, str, int]], *, unit: str, step: str, forwards_key: str) -> str:
    """Markdown: one row per recipe (`aggs` of its last evaluated step, in `recipes` order): the model FLOPs in
    `unit` (keys `<unit lowercased>_<phase>_mean`) per sample and `step` of each phase as the loop counted them
    (rollout / anchor / update, mean over the run's steps and seeds), their total and its ratio to the paper's
    recipe, the same ratio at the real size (`real_ratios`, sage_grpo.recipes.RECIPE_FLOP_RATIOS), the forwards per
    sample and step (`forwards_key`), then `columns` (title, key, decimals) as mean ± standard error over seeds."""
    cells = {a["recipe"]: a for a in aggs}
    paper = cells.get("paper")
    key = unit.lower()
    head = ["Recipe", f"{step.capitalize()}s", f"{unit} / sample / {step}: rollout / anchor / update", "Total",
            "vs paper", "vs paper, 8.3B at 81x352x624", f"Forwards / sample / {step}", "Seeds"]
    head += [t for t, _, _ in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in recipes:
        a = cells.get(name)
        if a is None:
            continue
        total = a[f"{key}_step_mean"]
        ratio = f"{total / paper[f'{key}_step_mean']:.2f}" if paper else "-"
        phases = " / ".join(f"{a[f'{key}_{k}_mean']:.2f}" for k in ("rollout", "anchor", "update"))
        vals = [mean_se_cell(a, k, d) for _, k, d in columns]
        real = real_ratios.get(name, math.nan)
        lines.append(f"| {name} | {a['steps']} | {phases} | {total:.2f} | {ratio} | {real:.2f}"
                     f" | {a[f'{forwards_key}_mean']:.2f} | {a['n']} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def format_equal_drift_table(results: Sequence[dict], recipes: Sequence[str], real_ratios: Mapping[str, float], *,
                             heldout_title: str) -> str:
    """Markdown of sage_grpo.lab.equal_drift's results, in `recipes` order: each recipe's gain and held-out change at
    the reference's drift, each minus the reference's own (paired by seed), and its drift at the reference's gain,
    mean ± standard error over seeds; a read past a recipe's last point is marked with the count of such seeds."""
    cells = {r["recipe"]: r for r in results}
    head = ["Recipe", "FLOPs vs paper (8.3B)", "Seeds", "Gain at the paper's drift", "Minus the paper's gain (paired)",
            heldout_title, "Minus the paper's (paired)", "Drift at the paper's gain"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in recipes:
        r = cells.get(name)
        if r is None:
            continue
        ext_g = f" ({r['extrapolated_gain']} extrapolated)" if r["extrapolated_gain"] else ""
        ext_d = f" ({r['extrapolated_drift']} extrapolated)" if r["extrapolated_drift"] else ""
        if r.get("unreached_drift"):
            ext_d += f" ({r['unreached_drift']} never reached, left out)"
        lines.append(f"| {name} | {real_ratios.get(name, math.nan):.2f} | {r['seeds']} | "
                     f"{_pm(r['gain_at_ref_drift'], 3)}{ext_g} | {_pm(r['gain_vs_reference'], 3)} | "
                     f"{_pm(r['heldout_at_ref_drift'], 3)} | {_pm(r['heldout_vs_reference'], 3)} | "
                     f"{_pm(r['drift_at_ref_gain'], 4)}{ext_d} |")
    return "\n".join(lines)


def plot_equal_drift(path: Path, aggs: Sequence[dict], results: Sequence[dict], real_ratios: Mapping[str, float], *,
                     unit: str, step: str, x_label: str, y_label: str, points: str) -> Path:
    """`path` (a PNG): reward gain against drift, one curve per recipe through its evaluated steps (mean over seeds,
    error bars = standard errors in both), from the base model at (0, 0); each point labelled with its step count,
    the legend with each recipe's FLOPs per `step` (in `unit` per sample) and its ratio at the real size; dotted
    lines at the paper's drift and gain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    by_recipe: dict[str, list[dict]] = defaultdict(list)
    for a in aggs:
        by_recipe[a["recipe"]].append(a)
    for i, (name, pts) in enumerate(by_recipe.items()):
        pts = sorted(pts, key=lambda a: int(a["steps"]))
        xs = [0.0] + [a["drift_mean"] for a in pts]
        ys = [0.0] + [a["reward_gain_mean"] for a in pts]
        cost = sum(a[f"{unit.lower()}_step_mean"] for a in pts) / len(pts)
        label = f"{name}: {cost:.2f} {unit}/sample/{step}, {real_ratios.get(name, math.nan):.2f}x at 8.3B"
        ax.plot(xs, ys, "-", color=f"C{i}", lw=1.2, label=label)
        ax.errorbar(xs[1:], ys[1:], xerr=[standard_error(a, "drift") for a in pts],
                    yerr=[standard_error(a, "reward_gain") for a in pts], fmt="o", color=f"C{i}", ms=4, capsize=2)
        for a in pts:
            ax.annotate(str(a["steps"]), (a["drift_mean"], a["reward_gain_mean"]), fontsize=6,
                        xytext=(3, 3), textcoords="offset points", color=f"C{i}")
    if results:
        ref = results[0]
        ax.axvline(ref["ref_drift"], color="grey", ls=":", lw=0.8)
        ax.axhline(ref["ref_gain"], color="grey", ls=":", lw=0.8)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlim(left=0)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(f"reward gain against drift; points = {points}, dotted = the paper's recipe at its last one",
                 fontsize=8)
    ax.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    return save_figure(fig, path, plt)
