"""Metrics of a run: `metrics.jsonl` always (one JSON object per step, slash keys: `reward/total`, `train/clipfrac`,
`kl/coef`, `perf/rollout_s`, `mem/peak_gib`), TensorBoard or Weights & Biases behind `--report_to`, and
`curves.png` (reward and KL against step). Only rank 0 creates a logger."""

from __future__ import annotations

import json
import math
from pathlib import Path

from sage_grpo.errors import SageGRPOError

__all__ = ["MetricsLogger", "check_report_to", "read_metrics", "plot_curves"]


def check_report_to(report_to: str) -> None:
    """Fail before any model loads when the chosen sink is not installed."""
    if report_to == "tensorboard":
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise SageGRPOError("--report_to tensorboard needs the tensorboard package: pip install tensorboard, "
                                "or pass --report_to none (metrics.jsonl is always written)") from None
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


class MetricsLogger:
    """Append-only metrics.jsonl plus the optional sink. On resume from step S the records of steps > S (written
    after that checkpoint by the interrupted run) are dropped first, so the file reads as one uninterrupted run."""

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

            self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"))
        elif report_to == "wandb":
            import wandb

            self._wandb = wandb.init(project=project or None, name=run_name or self.dir.name, config=config,
                                     dir=str(self.dir), resume="allow")

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


def plot_curves(metrics_path: str | Path, out_png: str | Path) -> Path | None:
    """Reward (mean +- std) and the KL terms and coefficient against step -> `out_png` (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = read_metrics(metrics_path)
    if not rows:
        return None

    def series(key):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(11, 4))
    x, y = series("reward/total_mean")
    ax_r.plot(x, y, label="rollout reward (mean)")
    _, sd = series("reward/total_std")
    if len(sd) == len(y):
        ax_r.fill_between(x, [a - b for a, b in zip(y, sd)], [a + b for a, b in zip(y, sd)], alpha=0.2)
    xv, yv = series("val/reward_total")
    if xv:
        ax_r.plot(xv, yv, "o-", label="validation reward (ODE)")
    ax_r.set_xlabel("step")
    ax_r.set_ylabel("reward")
    ax_r.legend()
    for key, label in (("kl/pos", "KL_pos"), ("kl/vel", "KL_vel"), ("kl/coef", "lambda_KL")):
        xk, yk = series(key)
        if xk and any(v > 0 for v in yk):
            ax_k.plot(xk, [max(v, 1e-30) for v in yk], label=label)
    ax_k.set_yscale("log")
    ax_k.set_xlabel("step")
    ax_k.set_title("KL terms and coefficient")
    if ax_k.lines:
        ax_k.legend()
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png
