#!/usr/bin/env python
"""Draw a run's curves.png again from its metrics.jsonl: after a run stopped before its last plot, after a resume,
or on another machine with the run folder copied (post_train.py draws it at each validation and at the end).

    python scripts/plot_curves.py --run outputs/demo/train                 # -> outputs/demo/train/curves.png
    python scripts/plot_curves.py --run outputs/demo/train/metrics.jsonl --out curves.png

The panels are sage_grpo.metrics.curves_figure's (docs/training.md, "Outputs"). Needs matplotlib (the "plot"
extra).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.cli import CLIParser, check_output_file  # noqa: E402
from sage_grpo.errors import SageGRPOError, run_cli  # noqa: E402


def main(argv=None) -> Path:
    p = CLIParser(description=__doc__)
    p.add_argument("--run", required=True, help="a post_train.py output_dir, or its metrics.jsonl")
    p.add_argument("--out", default=None, help="the PNG to write (default: curves.png beside metrics.jsonl)")
    args = p.parse_args(argv)
    metrics = Path(args.run)
    if metrics.is_dir() or not metrics.suffix:
        metrics = metrics / "metrics.jsonl"
    if not metrics.is_file():
        raise SageGRPOError(f"--run {args.run}: no metrics.jsonl there; pass a post_train.py output_dir or its "
                            "metrics.jsonl")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SageGRPOError("plot_curves.py needs matplotlib: pip install -e '.[plot]'") from None
    from sage_grpo.metrics import plot_curves

    out = check_output_file(args.out or metrics.parent / "curves.png", "--out")
    if plot_curves(metrics, out) is None:
        raise SageGRPOError(f"{metrics} has no rows yet: nothing to draw")
    print(f"[plot_curves] {metrics} -> {out}")
    return out


if __name__ == "__main__":
    run_cli(main)
