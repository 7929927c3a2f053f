"""The video lab (scripts/video_ablation.py): the toy lab's question asked of the real architecture. Each grid cell
is a short post_train.py run on a pretrained world model; this module holds what the script needs besides running
and sampling: the flags of a cell, the rows of a run, the table and the figures.

A run's row: the trained reward (world_caption by default) of ODE samples of the held-out captions, their held-out
metrics (`sage_grpo.world.metrics.heldout_metrics`), and their drift, the RMSE from the base model's samples of the
same captions and noise. Gains are trained minus base on that same noise, so they pair sample by sample.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from .grpo import LAB_SAMPLERS
from .report import aggregate, mean_se_cell, save_figure, standard_error
from .report import format_equal_drift_table as report_equal_drift_table
from .report import format_flop_table as report_flop_table
from .report import plot_equal_drift as report_plot_equal_drift

__all__ = [
    "VIDEO_SAMPLERS",
    "VIDEO_KLS",
    "TABLE_COLUMNS",
    "cell_flags",
    "cell_name",
    "reward_curve",
    "curve_gain",
    "run_row",
    "aggregate_runs",
    "format_video_table",
    "format_flop_table",
    "format_equal_drift_table",
    "plot_video_lab",
    "plot_equal_drift",
]

VIDEO_SAMPLERS = LAB_SAMPLERS  # the SDE samplers (ode has no exploration)
VIDEO_KLS = ("none", "dual")

# (column title, row key, decimals): the table's columns, each shown as mean ± standard error over seeds.
TABLE_COLUMNS = (
    ("Reward", "reward", 3),
    ("Reward gain", "reward_gain", 3),
    ("Rollout gain", "rollout_gain", 3),
    ("Shape fid.", "shape_fidelity", 3),
    ("Bg clean", "background_cleanliness", 3),
    ("Temporal", "temporal_consistency", 3),
    ("Persistence", "object_persistence", 3),
    ("Drift", "drift", 4),
)
# held-out metrics averaged into `heldout_change` (the y axis of the second panel): the ones no caption reward names
_FIDELITY = ("shape_fidelity", "background_cleanliness", "temporal_consistency", "object_persistence")


def cell_flags(sampler: str, kl: str, equalizer: bool, kl_weight: float) -> list[str]:
    """post_train.py flags of one cell. KL "none" = --kl_weight 0 (no KL term, no anchor); "dual" = the dual trust
    region of the paper at the config's --kl_weight: a moving anchor plus the step-wise term. `kl_weight` is the
    config's, checked here so that "dual" can never silently run without a KL term."""
    if sampler not in VIDEO_SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; use one of {', '.join(VIDEO_SAMPLERS)}")
    flags = ["--sde_type", sampler, "--use_grad_balancing", str(bool(equalizer))]
    if kl == "none":
        return flags + ["--kl_weight", "0"]
    if kl == "dual":
        if not kl_weight > 0:
            raise ValueError(f"KL 'dual' needs a config with kl_weight > 0, got {kl_weight}")
        return flags + ["--use_dual_kl", "True", "--use_moving_KL", "True"]
    raise ValueError(f"unknown KL variant {kl!r}; use one of {', '.join(VIDEO_KLS)}")


def cell_name(sampler: str, kl: str, equalizer: bool, seed: int) -> str:
    return f"{sampler}_eq{'on' if equalizer else 'off'}_kl{kl}_s{seed}"


def reward_curve(metrics_path: str | Path) -> list[tuple[int, float]]:
    """(step, mean rollout reward) of every logged step of a post_train.py run's metrics.jsonl that has one."""
    out = []
    for line in Path(metrics_path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row.get("reward/total_mean") is not None:
                out.append((int(row["step"]), float(row["reward/total_mean"])))
    return out


def curve_gain(rewards: Sequence[float]) -> float:
    """Mean of the last quarter of a reward curve minus the mean of its first quarter (at least one step each):
    the rollout reward the run gained, less noisy than last minus first."""
    if not rewards:
        raise ValueError("an empty reward curve has no gain")
    k = max(1, len(rewards) // 4)
    return sum(rewards[-k:]) / k - sum(rewards[:k]) / k


def _mean(x: torch.Tensor) -> float:
    return float(x.float().mean())


def run_row(tag: Mapping, *, reward: torch.Tensor, base_reward: torch.Tensor, metrics: Mapping[str, torch.Tensor],
            base_metrics: Mapping[str, torch.Tensor], curve: Sequence[tuple[int, float]]) -> dict:
    """One run -> its summary row: `tag` (sampler, equalizer, kl, seed, ...), then the trained reward of the
    held-out samples and its gain over the base model's samples of the same noise, the rollout reward curve's first,
    last and gain, every held-out metric with its `base_` value, `drift` (mean `reference_distance`) and
    `heldout_change` (mean change of the metrics no caption reward names)."""
    rewards = [r for _, r in curve]
    row = dict(tag)
    row["reward"], row["base_reward"] = _mean(reward), _mean(base_reward)
    row["reward_gain"] = _mean(reward - base_reward)
    row["rollout_first"], row["rollout_last"] = rewards[0], rewards[-1]
    row["rollout_gain"] = curve_gain(rewards)
    for k, v in metrics.items():
        if k == "reference_distance":
            row["drift"] = _mean(v)
        else:
            row[k], row[f"base_{k}"] = _mean(v), _mean(base_metrics[k])
    row["heldout_change"] = sum(row[k] - row[f"base_{k}"] for k in _FIDELITY) / len(_FIDELITY)
    return row


def aggregate_runs(rows: Sequence[dict]) -> list[dict]:
    """Rows -> one row per (sampler, equalizer, kl): `n` and `<metric>_mean` / `<metric>_std` over seeds."""
    return aggregate(rows, keys=("sampler", "equalizer", "kl"))


def format_video_table(aggs: Sequence[dict], samplers: Sequence[str], kls: Sequence[str]) -> str:
    """Markdown: the base model first (its values are the same in every cell of a seed), then sampler x equalizer x
    KL in that order, each value mean ± standard error over the cell's seeds (column Seeds; the mean alone for
    one seed); cells missing from `aggs` are skipped."""
    cells = {(a["sampler"], bool(a["equalizer"]), a["kl"]): a for a in aggs}
    if not cells:
        return ""
    head = ["Method", "Equalizer", "KL", "Seeds"] + [t for t, _, _ in TABLE_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    any_cell = max(cells.values(), key=lambda a: a["n"])  # the base model over the most seeds
    base = [mean_se_cell(any_cell, f"base_{k}", d) if f"base_{k}_mean" in any_cell else "-"
            for _, k, d in TABLE_COLUMNS]
    lines.append(f"| Base model | - | - | {any_cell['n']} | " + " | ".join(base) + " |")
    for sampler in samplers:
        for eq in (False, True):
            for kl in kls:
                a = cells.get((sampler, eq, kl))
                if a is not None:
                    vals = [mean_se_cell(a, k, d) for _, k, d in TABLE_COLUMNS]
                    lines.append(f"| {sampler} | {'on' if eq else 'off'} | {kl} | {a['n']} | " + " | ".join(vals)
                                 + " |")
    return "\n".join(lines)


# (column title, row key, decimals) of the recipes' table (scripts/video_ablation.py --recipes), mean ± standard
# error over seeds: what a step costs and what it learns
RECIPE_COLUMNS = (
    ("Reward gain", "reward_gain", 3),
    ("Rollout gain", "rollout_gain", 3),
    ("Held-out change", "heldout_change", 3),
    ("Drift", "drift", 4),
)


def format_flop_table(aggs: Sequence[dict], recipes: Sequence[str], real_ratios: Mapping[str, float]) -> str:
    """report.format_flop_table of the video lab: GFLOP per sample and GRPO step, RECIPE_COLUMNS."""
    return report_flop_table(aggs, recipes, real_ratios, RECIPE_COLUMNS, unit="GFLOP", step="step",
                             forwards_key="forwards_per_step")


def format_equal_drift_table(results: Sequence[dict], recipes: Sequence[str], real_ratios: Mapping[str, float]) -> str:
    """report.format_equal_drift_table of the video lab (held-out change: the 4 fidelity metrics' mean)."""
    return report_equal_drift_table(results, recipes, real_ratios, heldout_title="Held-out change at the paper's drift")


def plot_equal_drift(out_dir: Path, aggs: Sequence[dict], results: Sequence[dict],
                     real_ratios: Mapping[str, float]) -> Path:
    """report.plot_equal_drift of the video lab -> out_dir/equal_drift.png."""
    return report_plot_equal_drift(
        out_dir / "equal_drift.png", aggs, results, real_ratios, unit="GFLOP", step="step",
        x_label="drift from the base model (RMSE of held-out samples, same noise)",
        y_label="trained reward gain (held-out captions)", points="GRPO steps")


def plot_video_lab(out_dir: Path, rows: Sequence[dict], aggs: Sequence[dict], curves: Sequence[dict]) -> list[Path]:
    """Figures -> paths: stability_plasticity.png (reward gain against drift and against the held-out change, one
    marker per cell at its mean over seeds, error bars = standard errors over seeds, small dots = single runs;
    colour = sampler, square = dual KL, circle = no KL, filled = equalizer on) and reward_curves.png (rollout reward
    per step, mean over seeds, one panel per sampler; solid = equalizer on, colour = KL)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samplers = list(dict.fromkeys(a["sampler"] for a in aggs))
    colors = {s: f"C{i}" for i, s in enumerate(samplers)}
    written = []

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (xkey, xlabel) in zip(axes, (("drift", "drift from the base model (RMSE, same noise; lower = stabler)"),
                                         ("heldout_change", "held-out change vs base (mean of 4 fidelity metrics)"))):
        for r in rows:
            ax.plot(r[xkey], r["reward_gain"], ".", color=colors[r["sampler"]], alpha=0.35, ms=4)
        for a in aggs:
            filled = bool(a["equalizer"])
            ax.errorbar(a[f"{xkey}_mean"], a["reward_gain_mean"], xerr=standard_error(a, xkey),
                        yerr=standard_error(a, "reward_gain"),
                        fmt="s" if a["kl"] == "dual" else "o", color=colors[a["sampler"]], ms=7, capsize=2,
                        markerfacecolor=colors[a["sampler"]] if filled else "white")
        ax.axhline(0, color="grey", lw=0.6)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("trained reward gain (held-out captions)")
    axes[0].set_xlim(left=0)  # zero drift = the base model itself
    axes[1].axvline(0, color="grey", lw=0.6)
    handles = [plt.Line2D([], [], color=colors[s], marker="o", ls="", label=s) for s in samplers]
    handles += [plt.Line2D([], [], color="k", marker=m, ls="", markerfacecolor=f, label=lab) for m, f, lab in
                (("o", "k", "KL none"), ("s", "k", "KL dual"), ("o", "k", "equalizer on"),
                 ("o", "white", "equalizer off"))]
    axes[1].legend(handles=handles, fontsize=7)
    fig.suptitle("stability (small drift, held-out kept) vs plasticity (reward gain)", fontsize=9)
    fig.tight_layout()
    written.append(save_figure(fig, out_dir / "stability_plasticity.png", plt))

    fig, axes = plt.subplots(1, len(samplers), figsize=(3.6 * len(samplers), 3.2), sharey=True, squeeze=False)
    kls = list(dict.fromkeys(a["kl"] for a in aggs))
    for ax, sampler in zip(axes[0], samplers):
        for j, kl in enumerate(kls):
            for eq in (True, False):
                by_step: dict[int, list[float]] = defaultdict(list)
                for c in curves:
                    if (c["sampler"], c["kl"], bool(c["equalizer"])) == (sampler, kl, eq):
                        by_step[c["step"]].append(c["reward"])
                if by_step:
                    steps = sorted(by_step)
                    ax.plot(steps, [sum(by_step[s]) / len(by_step[s]) for s in steps], color=f"C{j}",
                            linestyle="-" if eq else "--", label=f"KL {kl} ({'eq' if eq else 'no eq'})")
        ax.set_title(sampler)
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("rollout reward (mean)")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    written.append(save_figure(fig, out_dir / "reward_curves.png", plt))
    return written

