"""Metrics of a run: `metrics.jsonl` always (one JSON object per step, slash keys: `reward/total`, `train/clipfrac`,
`kl/coef`, `val/VQ`, `val_shift/saturation`, `perf/rollout_s`, `mem/peak_gib`), TensorBoard or Weights & Biases
behind `--report_to` (the scalars, the validation videos as frame strips and the resolved config), and `curves.png`
(reward with its band, the KL terms, the KL coefficient, clip fraction, gradient norm and learning rate against
step, and the held-out metrics beside the trained reward). Only rank 0 creates a logger."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from sage_grpo.errors import SageGRPOError

__all__ = ["MetricsLogger", "check_report_to", "read_metrics", "frame_strip", "curves_figure", "plot_curves"]


def check_report_to(report_to: str) -> None:
    """Fail before any model loads when the chosen sink is not installed."""
    if report_to == "tensorboard":
        try:
            import tensorboard  # noqa: F401
        except ImportError:  # a dependency of the package: only a broken or partial install lacks it
            raise SageGRPOError("--report_to tensorboard needs the tensorboard package, a dependency of sage-grpo: "
                                "pip install -e . (or pip install tensorboard), or pass --report_to none "
                                "(metrics.jsonl is always written)") from None
    elif report_to == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise SageGRPOError("--report_to wandb needs the wandb package: pip install -e '.[logging]', or pass "
                                "--report_to tensorboard|none") from None


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# A validation video goes to the dashboards as one image: STRIP_FRAMES frames evenly spaced from first to last, side
# by side, each scaled down to at most STRIP_HEIGHT pixels high. TensorBoard's add_video and wandb.Video from frames
# need moviepy (not a dependency); a strip needs nothing more, shows the motion at a glance, and keeps a 480p
# validation set to well under a megabyte per video in the event file.
STRIP_FRAMES = 8
STRIP_HEIGHT = 160


def frame_strip(frames: torch.Tensor) -> torch.Tensor:
    """Video frames [F, 3, H, W] in [0, 1] -> one image [3, h, k * w] (k <= STRIP_FRAMES, h <= STRIP_HEIGHT)."""
    if frames.ndim != 4 or frames.shape[1] != 3:
        raise ValueError(f"expected frames [F, 3, H, W], got {tuple(frames.shape)}")
    n = frames.shape[0]
    pick = torch.linspace(0, n - 1, min(n, STRIP_FRAMES)).round().long()
    x = frames[pick].detach().float().cpu().clamp(0, 1)
    h, w = x.shape[-2:]
    if h > STRIP_HEIGHT:
        x = torch.nn.functional.interpolate(x, size=(STRIP_HEIGHT, max(1, round(w * STRIP_HEIGHT / h))), mode="area")
    return torch.cat(list(x), dim=2)  # frames side by side along the width


class MetricsLogger:
    """Append-only metrics.jsonl plus the optional sink. On resume from step S the records of steps > S (written
    after that checkpoint by the interrupted run) are dropped first, so the file reads as one uninterrupted run;
    TensorBoard drops them too (purge_step), else its curves show both runs' steps after S."""

    def __init__(self, output_dir: str | Path, *, report_to: str = "none", run_name: str = "", project: str = "",
                 config: dict | None = None, resume_step: int | None = None):
        self.dir = Path(output_dir)
        self.path = self.dir / "metrics.jsonl"
        self.dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        else:
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._tb = self._wandb = None
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"),
                                     purge_step=None if resume_step is None else resume_step + 1)
            if config is not None:  # wandb keeps the config itself (wandb.init below); TensorBoard gets it as text
                import yaml

                text = yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=120)
                # indented 4 spaces: TensorBoard renders text as markdown, and this keeps it a preformatted block
                self._tb.add_text("config", "".join("    " + line + "\n" for line in text.splitlines()),
                                  resume_step or 0)
                self._tb.flush()
        elif report_to == "wandb":
            import wandb

            self._wandb = wandb.init(project=project or None, name=run_name or self.dir.name, config=config,
                                     dir=str(self.dir), resume="allow")

    @property
    def wants_media(self) -> bool:
        """Whether `log_videos` goes anywhere (callers skip reading the videos back otherwise)."""
        return self._tb is not None or self._wandb is not None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        numeric = {k: v for k, v in row.items() if k != "step" and isinstance(v, int | float)}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def log_videos(self, step: int, videos: dict[str, torch.Tensor]) -> None:
        """Validation videos {name: frames [F, 3, H, W] in [0, 1]} -> `samples/<name>` as a frame strip
        (`frame_strip`) in TensorBoard or wandb; metrics.jsonl keeps numbers only (the mp4s are on disk)."""
        if not videos or not self.wants_media:
            return
        strips = {f"samples/{name}": frame_strip(frames) for name, frames in videos.items()}
        if self._tb is not None:
            for tag, strip in strips.items():
                self._tb.add_image(tag, strip, step)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            self._wandb.log({tag: wandb.Image((strip * 255).round().byte().permute(1, 2, 0).numpy(), caption=tag)
                             for tag, strip in strips.items()}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(v):
    """JSON-safe scalar: non-finite floats become null rather than invalid JSON."""
    if isinstance(v, bool | int | str) or v is None:
        return v
    v = float(v)
    return v if math.isfinite(v) else None


def _series(rows: list[dict], key: str, keep=lambda row, value: True) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and keep(r, r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def _line_styles(n: int) -> list[tuple]:
    """`n` (colour, line style) pairs, no two alike: matplotlib's default cycle has 10 colours, and a world run logs
    more held-out metrics than that (the 11th line was drawn in the 1st one's blue). tab20's 10 dark colours first,
    then its 10 light ones (each the pale twin of a dark one), then the same 20 dashed, dotted and dash-dotted."""
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    order = [*range(0, 20, 2), *range(1, 20, 2)]  # dark, then light
    styles = ("-", "--", ":", "-.")
    return [(cmap(order[i % 20]), styles[(i // 20) % len(styles)]) for i in range(n)]


def curves_figure(rows: list[dict]):
    """The figure of `plot_curves` for metrics rows (matplotlib Figure; the caller closes it).

    Panels: rollout reward mean with a mean +- std band (and the validation reward), the KL terms, the KL
    coefficient, the clip fraction, the gradient norm and the learning rate; below them, across the figure, the
    validation's trained reward and held-out metrics as `val_shift/<name>` (change since the first validation in
    spreads over the validation videos, `sage_grpo.hacking.shift`: one axis for metrics of any scale), with the
    validations that raised a hacking warning marked (red dashed lines). The KL terms are on a log axis
    (they span decades as the policy moves away from its anchor) without the steps where the anchor equals the
    policy (`kl/anchor_synced` = 1: the first step and the step after each refresh), where KL_pos and KL_vel are
    exactly 0: a log axis cannot show a zero, and clamping it to a tiny value drew a saw-tooth over ~28 decades at
    every refresh. The line breaks there, and those steps are marked by dotted vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig = plt.figure(figsize=(15, 11))
    grid = fig.add_gridspec(3, 3)
    ax_r, ax_k, ax_c, ax_f, ax_g, ax_l = (fig.add_subplot(grid[i // 3, i % 3]) for i in range(6))
    ax_h = fig.add_subplot(grid[2, :])
    style = {"marker": "." if len(rows) <= 60 else None, "linewidth": 1.2}

    # reward: the band uses the rows that have both the mean and the std
    both = [r for r in rows if r.get("reward/total_mean") is not None and r.get("reward/total_std") is not None]
    x = [r["step"] for r in both]
    mean = [r["reward/total_mean"] for r in both]
    std = [r["reward/total_std"] for r in both]
    ax_r.plot(*_series(rows, "reward/total_mean"), label="rollout reward (mean)", **style)
    if both:
        ax_r.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.25,
                          label="mean +- std over the step's videos")
    xv, yv = _series(rows, "val/reward_total")
    if xv:
        ax_r.plot(xv, yv, "o-", label="validation reward (ODE)")
    ax_r.set_title("reward")

    synced = [r["step"] for r in rows if r.get("kl/anchor_synced") == 1]
    for key, label in (("kl/pos", "KL_pos"), ("kl/vel", "KL_vel"), ("kl/loss", "L_KL")):
        xk, yk = _series(rows, key)
        # NaN, not dropped: the line breaks at each refresh, so each anchor period reads as its own segment
        yk = [v if v > 0 and r.get("kl/anchor_synced") != 1 else math.nan
              for v, r in zip(yk, (r for r in rows if r.get(key) is not None))]
        if any(math.isfinite(v) for v in yk):
            # L_KL equals beta_pos KL_pos when KL_vel is 0 (one update per rollout): hollow, so KL_pos stays visible
            kw = {**style, "marker": "o", "mfc": "none", "ms": 7} if key == "kl/loss" else style
            ax_k.plot(xk, yk, label=label, **kw)
    if ax_k.lines:
        ax_k.set_yscale("log")
    for i, s in enumerate(synced):
        ax_k.axvline(s, color="0.6", linestyle=":", linewidth=1,
                     label="anchor = policy (KL exactly 0, not drawn)" if i == 0 else None)
    ax_k.set_title("KL terms to the anchor")

    for ax, key, title, log in ((ax_c, "kl/coef", "KL coefficient lambda_KL", True),
                                (ax_f, "train/clipfrac", "clip fraction", False),
                                (ax_g, "train/grad_norm", "gradient norm (before clipping)", True),
                                (ax_l, "train/lr", "learning rate", False)):
        xs, ys = _series(rows, key, keep=lambda r, v, log=log: v > 0 or not log)  # a log axis shows no zero
        if xs:
            ax.plot(xs, ys, **style)
            if log:
                ax.set_yscale("log")
        ax.set_title(title)
    shifts = sorted({k for r in rows for k in r if k.startswith("val_shift/")} - {"val_shift/reward_total"})
    xs, ys = _series(rows, "val_shift/reward_total")
    if xs:
        ax_h.plot(xs, ys, "o-", color="black", linewidth=2.5, label="trained reward")
    for key, (colour, dashes) in zip(shifts, _line_styles(len(shifts))):
        ax_h.plot(*_series(rows, key), marker="." if len(rows) <= 60 else None, color=colour, linestyle=dashes,
                  linewidth=1.2, label=key.split("/", 1)[1])
    count = 0
    for r in rows:
        n = r.get("val/hacking_warnings")
        if n is not None and n > count:
            ax_h.axvline(r["step"], color="red", linestyle="--", linewidth=1.2,
                         label="hacking warning" if count == 0 else None)
            count = n
    if ax_h.lines:
        ax_h.axhline(0, color="0.6", linewidth=0.8)
    ax_h.set_title("validation: trained reward and held-out metrics, change since the first validation (in spreads "
                   "over the validation videos)")
    for ax in fig.axes:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps, not 1.25
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, ncol=1 if ax is not ax_h else 4)
        if not ax.lines and not ax.collections:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes,
                    color="0.5")
    # Fixed margins, not tight_layout: it measures every tick label of the 7 panels (0.4 of the 0.9 CPU seconds a
    # figure costs), paid at every validation and at the end of every run; these margins hold the widest labels the
    # panels draw (a log axis' "1.325 x 10^-2")
    fig.subplots_adjust(left=0.05, right=0.985, bottom=0.05, top=0.965, wspace=0.25, hspace=0.35)
    return fig


def plot_curves(metrics_path: str | Path, out_png: str | Path) -> Path | None:
    """`curves_figure` of metrics.jsonl -> `out_png` (None without matplotlib or without rows)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    rows = read_metrics(metrics_path)
    if not rows:
        return None
    import matplotlib.pyplot as plt

    fig = curves_figure(rows)
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png
