"""Recipes compared at equal drift: what each recipe gains where it has moved the model as far as the reference
recipe has, and how far it moves to gain what the reference gains.

A recipe's curve is its runs' (drift, gain) at increasing strength of one trust-region knob (scripts/video_ablation.py
--eval_every: the number of GRPO steps, every checkpoint of one run), starting at the base model (0, 0). The
reference point is the reference recipe (the paper's) at its full strength, mean over seeds: (D_ref, G_ref). Per seed
(the same captions and noise in every recipe), each curve is read at D_ref (the gain, and the held-out change, at
the reference's drift) and at G_ref (the drift at the reference's gain) by linear interpolation along the path;
past its last point on the line from the base model through that point (counted in `extrapolated`). Means and
standard errors are over seeds; `gain_vs_reference` pairs each seed's gain at D_ref with the reference's own gain on
that seed, and `heldout_vs_reference` its held-out change at D_ref with the reference's own held-out change.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

__all__ = ["curve_of", "read_along", "equal_drift"]


def curve_of(rows: Sequence[dict], keys: Sequence[str] = ("drift", "reward_gain", "heldout_change")) -> list[tuple]:
    """One run's rows (one per evaluated step) -> its path [(0, ...), (x, y, ...) per step in step order]: the base
    model first (no drift, no gain, no change)."""
    pts = sorted(rows, key=lambda r: int(r["steps"]))
    return [tuple(0.0 for _ in keys)] + [tuple(float(r[k]) for k in keys) for r in pts]


def read_along(path: Sequence[tuple], x: int, y: int, at: float) -> tuple[float, bool]:
    """The value of coordinate `y` where the path (from the base model at the origin) first reaches x = `at` (linear
    between the two points around the crossing) -> (value, extrapolated). A path that never reaches `at` is read on
    the line from the origin through its last point, y_last * at / x_last (extrapolated True): steadier than its
    last segment, whose slope two noisy points decide; NaN where that line never reaches `at` (a last point at
    x = 0, or on the other side of 0: a gain that ended negative never reaches a positive gain)."""
    for a, b in zip(path[:-1], path[1:]):
        lo, hi = sorted((a[x], b[x]))
        if lo <= at <= hi and b[x] != a[x]:
            w = (at - a[x]) / (b[x] - a[x])
            return a[y] + w * (b[y] - a[y]), False
    last = path[-1]
    if last[x] * at <= 0:  # the curve ends on the other side of 0 (a gain that fell below zero): no line reaches `at`
        return math.nan, True
    return last[y] * at / last[x], True


def _mean_se(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error) of the finite values (a read no line reaches is NaN, counted apart)."""
    values = [v for v in values if math.isfinite(v)]
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def equal_drift(rows: Sequence[dict], reference: str = "paper", *, ref_steps: int | None = None) -> list[dict]:
    """Rows {recipe, seed, steps, drift, reward_gain, heldout_change, ...} of every evaluated checkpoint -> one dict
    per recipe (the reference's first): seeds, the reference point (ref_drift, ref_gain: the reference recipe at
    `ref_steps`, default its most steps, mean over its seeds) and, as (mean, standard error) over seeds,
    gain_at_ref_drift, heldout_at_ref_drift, gain_vs_reference and heldout_vs_reference (paired by seed, where the
    reference ran that seed),
    drift_at_ref_gain, with the count of seeds each read extrapolated past the recipe's last point
    (unreached_drift: the seeds whose gain never reaches the reference's on any line, left out of the mean)."""
    runs: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        runs[r["recipe"]][int(r["seed"])].append(r)
    if reference not in runs:
        raise ValueError(f"no rows of the reference recipe {reference!r}")
    ref_steps = ref_steps or max(int(r["steps"]) for s in runs[reference].values() for r in s)
    ref = {seed: next(r for r in rs if int(r["steps"]) == ref_steps) for seed, rs in runs[reference].items()
           if any(int(r["steps"]) == ref_steps for r in rs)}
    if not ref:
        raise ValueError(f"the reference recipe {reference!r} has no evaluated step {ref_steps}")
    d_ref = sum(float(r["drift"]) for r in ref.values()) / len(ref)
    g_ref = sum(float(r["reward_gain"]) for r in ref.values()) / len(ref)
    out = []
    for recipe in sorted(runs, key=lambda n: (n != reference, n)):
        gains, held, paired, paired_held, drifts, ext_g, ext_d = [], [], [], [], [], 0, 0
        for seed, rs in sorted(runs[recipe].items()):
            path = curve_of([r for r in rs if recipe != reference or int(r["steps"]) <= ref_steps])
            g, e = read_along(path, 0, 1, d_ref)
            h, _ = read_along(path, 0, 2, d_ref)
            d, f = read_along(path, 1, 0, g_ref)
            gains.append(g)
            held.append(h)
            drifts.append(d)
            ext_g, ext_d = ext_g + e, ext_d + f
            if seed in ref:
                paired.append(g - float(ref[seed]["reward_gain"]))
                paired_held.append(h - float(ref[seed]["heldout_change"]))
        out.append({"recipe": recipe, "seeds": len(gains), "ref_steps": ref_steps, "ref_drift": d_ref,
                    "ref_gain": g_ref, "gain_at_ref_drift": _mean_se(gains), "heldout_at_ref_drift": _mean_se(held),
                    "gain_vs_reference": _mean_se(paired) if paired else (math.nan, math.nan),
                    "heldout_vs_reference": _mean_se(paired_held) if paired_held else (math.nan, math.nan),
                    "drift_at_ref_gain": _mean_se(drifts), "extrapolated_gain": ext_g, "extrapolated_drift": ext_d,
                    "unreached_drift": sum(not math.isfinite(d) for d in drifts)})
    return out
