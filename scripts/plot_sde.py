"""Per-step noise of the samplers (paper Fig. 9), the equalizer weights S_t, and the gradient-scale proxy N_t
against sigma (paper Fig. 4), for one rollout schedule. Prints the tables and writes PNGs.

    python scripts/plot_sde.py --steps 20 --shift 5 --eta 0.5 --out outputs/sde_plots

A step whose variance is 0 (cps's last step) has no gradient scale: the plots leave it out (the equalizer's N_t = 1
guard is not a measurement), and the training update never trains it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from sage_grpo.cli import CLIParser, at_least, check_writable_dir
from sage_grpo.config import Config
from sage_grpo.equalizer import equalizer_weights, gradient_scale
from sage_grpo.errors import SageGRPOError, run_cli
from sage_grpo.schedule import sigma_schedule
from sage_grpo.sde import SAGE_SIGMA_CLAMP, check_sage_schedule, step_variance

SDES = ("sage_grpo", "flow_grpo", "dance_grpo", "cps")


def tables(
    steps: int, shift: float, eta: float, sage_clamp: float = SAGE_SIGMA_CLAMP
) -> dict[str, dict[str, list[float]]]:
    """{sampler: {"std": [T], "N": [T], "S": [T]}} and the schedule under key "sigma"."""
    sig = sigma_schedule(steps, shift)
    out: dict[str, dict[str, list[float]]] = {"sigma": {"sigma": sig.tolist()}}
    for sde in SDES:
        var = step_variance(sde, sig[:-1], sig[1:], eta, sigma_max=sig[1], sage_clamp=sage_clamp)
        out[sde] = {
            "std": var.clamp(min=0).sqrt().tolist(),
            "N": gradient_scale(sde, sig, eta, sage_clamp=sage_clamp).tolist(),
            "S": equalizer_weights(sde, sig, eta, sage_clamp=sage_clamp).tolist(),
        }
    return out


def plotted(t: dict, sde: str, key: str) -> list[float]:
    """The values a plot shows: N_t and S_t of a zero-variance step are NaN (not drawn), since its N_t = 1 is the
    equalizer's guard, not a gradient scale."""
    vals = t[sde][key]
    if key == "std":
        return list(vals)
    return [float("nan") if std == 0 else v for v, std in zip(vals, t[sde]["std"])]


def print_tables(t: dict, steps: int, shift: float, eta: float) -> None:
    """The std and S_t tables, one row per step."""
    print(f"schedule: T = {steps}, shift = {shift}, eta = {eta}")
    head = "step  sigma   " + "  ".join(f"{s:>10}" for s in SDES)
    for key, title in (("std", "noise std sqrt(V_t) per step"), ("S", "equalizer weight S_t per step")):
        print(f"\n{title}\n{head}")
        for i in range(steps):
            vals = "  ".join(f"{t[s][key][i]:>10.4f}" for s in SDES)
            print(f"{i:>4}  {t['sigma']['sigma'][i]:.4f}  {vals}")


def plot(t: dict, steps: int, shift: float, eta: float, out: Path) -> list[Path]:
    """Write three PNGs into `out`; returns their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SageGRPOError("plots need matplotlib: pip install -e '.[plot]' (tables were printed)") from None
    out.mkdir(parents=True, exist_ok=True)
    sig = t["sigma"]["sigma"][:-1]
    x = list(range(steps))
    paths = []
    specs = [
        ("sde_std.png", "std", "step", "noise std per "
                                       "step", f"Injected noise per step (T={steps}, shift={shift}, "
                                               f"eta={eta})", x, "linear"),
        ("equalizer_weights.png", "S", "step", "S_t", "Gradient-norm equalizer weights S_t", x, "log"),
        ("gradient_scale.png", "N", "sigma_t", "N_t (|d mean/d v| / sqrt(V_t); cps: x "
                                               "sqrt(V_t))", "Gradient-scale proxy against sigma", sig, "log"),
    ]
    for name, key, xlabel, ylabel, title, xs, yscale in specs:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for sde in SDES:
            ax.plot(xs, plotted(t, sde, key), marker="o", ms=3, label=sde)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_yscale(yscale)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    """CLI entry point."""
    r = Config().rollout  # the rollout's defaults
    p = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=r.grpo_sampling_steps, help="rollout steps T >= 1 (default "
                                                                            "%(default)s)")
    p.add_argument("--shift", type=float, default=r.flow_shift, help="schedule shift > 0 (default %(default)g)")
    p.add_argument("--eta", type=float, default=r.eta,
                   help="noise level eta in (0, 1] (default %(default)g; cps needs <= 1)")
    p.add_argument("--sage_sigma_clamp", type=float, default=r.sage_sigma_clamp,
                   help="sage_grpo's sigma clamp inside the log, in (0, 1) (default %(default)g)")
    p.add_argument("--out", default="outputs/sde_plots", help="folder for the PNGs (default %(default)s)")
    p.add_argument("--no-plots", action="store_true", help="print the tables only")
    args = p.parse_args(argv)
    at_least("--steps", args.steps, 1)
    at_least("--shift", args.shift, 0, strict=True)
    if not 0 < args.eta <= 1:
        raise SageGRPOError(f"--eta must be in (0, 1], got {args.eta:g} (at 0 no sampler injects noise and every "
                            "S_t is 1; cps needs eta <= 1)")
    if not 0 < args.sage_sigma_clamp < 1:
        raise SageGRPOError(f"--sage_sigma_clamp must be in (0, 1), got {args.sage_sigma_clamp:g}")
    if not args.no_plots:
        check_writable_dir(args.out, "--out")
    torch.set_printoptions(precision=4)
    if args.eta > 0:  # every sage_grpo step must inject noise (at eta = 0 every sampler is the ODE)
        check_sage_schedule(args.steps, args.shift, args.sage_sigma_clamp)
    t = tables(args.steps, args.shift, args.eta, args.sage_sigma_clamp)
    print_tables(t, args.steps, args.shift, args.eta)
    if not args.no_plots:
        for path in plot(t, args.steps, args.shift, args.eta, Path(args.out)):
            print(f"wrote {path}")


if __name__ == "__main__":
    run_cli(main)
