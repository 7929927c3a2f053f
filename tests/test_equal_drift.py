"""sage_grpo.lab.equal_drift: recipes read at the reference recipe's drift and gain, against hand-computed values."""

import math

import numpy as np
import pytest

from sage_grpo.lab.equal_drift import curve_of, equal_drift, read_along


def _rows(recipe, seed, points):
    return [{"recipe": recipe, "seed": seed, "steps": s, "drift": d, "reward_gain": g, "heldout_change": h}
            for s, (d, g, h) in points.items()]


def test_read_along_interpolates_at_the_first_crossing_and_extends_the_last_segment():
    path = [(0.0, 0.0), (0.1, 0.02), (0.2, 0.06)]
    assert read_along(path, 0, 1, 0.15) == (pytest.approx(0.04), False)
    assert read_along(path, 1, 0, 0.01) == (pytest.approx(0.05), False)  # drift where the gain is 0.01
    v, ext = read_along(path, 0, 1, 0.3)  # past the last point: the line through the origin and (0.2, 0.06)
    assert ext and v == pytest.approx(0.09)
    assert read_along([(0.0, 0.0), (0.1, 0.03), (0.2, 0.01)], 1, 0, 0.02) == (pytest.approx(0.1 * 2 / 3), False)


def test_curve_starts_at_the_base_model_in_step_order():
    rows = _rows("a", 0, {10: (0.2, 0.03, -0.01), 5: (0.1, 0.01, 0.0)})
    assert curve_of(rows) == [(0.0, 0.0, 0.0), (0.1, 0.01, 0.0), (0.2, 0.03, -0.01)]


def test_equal_drift_against_numpy_interpolation_per_seed():
    """Two seeds: the reference point is the paper's mean at its last step; each recipe is read per seed with
    np.interp on its (monotone) path, and the paired gain is the seed's read minus the paper's gain on that seed."""
    rng = np.random.default_rng(0)
    rows = []
    paper_final = {}
    for seed in (0, 1):
        d = np.sort(rng.uniform(0.02, 0.2, 3))
        g = np.sort(rng.uniform(0.0, 0.05, 3))
        rows += _rows("paper", seed, {5 * (i + 1): (d[i], g[i], -g[i]) for i in range(3)})
        paper_final[seed] = (d[-1], g[-1])
        d2, g2 = np.sort(rng.uniform(0.05, 0.4, 3)), np.sort(rng.uniform(0.0, 0.2, 3))
        rows += _rows("cheap", seed, {5 * (i + 1): (d2[i], g2[i], 0.5 * g2[i]) for i in range(3)})
    out = {r["recipe"]: r for r in equal_drift(rows)}
    d_ref = np.mean([v[0] for v in paper_final.values()])
    g_ref = np.mean([v[1] for v in paper_final.values()])
    assert out["paper"]["ref_drift"] == pytest.approx(d_ref) and out["cheap"]["ref_gain"] == pytest.approx(g_ref)
    reads, drifts = [], []
    for seed in (0, 1):
        r = sorted((x for x in rows if x["recipe"] == "cheap" and x["seed"] == seed), key=lambda x: x["steps"])
        xs = np.array([0.0] + [x["drift"] for x in r])
        ys = np.array([0.0] + [x["reward_gain"] for x in r])
        assert xs[0] <= d_ref <= xs[-1] and ys[0] <= g_ref <= ys[-1]  # inside the path: no extrapolation here
        reads.append(np.interp(d_ref, xs, ys))
        drifts.append(np.interp(g_ref, ys, xs))
    mean, se = out["cheap"]["gain_at_ref_drift"]
    assert mean == pytest.approx(np.mean(reads)) and se == pytest.approx(np.std(reads, ddof=1) / math.sqrt(2))
    paired = [reads[s] - paper_final[s][1] for s in (0, 1)]
    assert out["cheap"]["gain_vs_reference"][0] == pytest.approx(np.mean(paired))
    assert out["cheap"]["drift_at_ref_gain"][0] == pytest.approx(np.mean(drifts))
    assert out["cheap"]["heldout_at_ref_drift"][0] == pytest.approx(0.5 * np.mean(reads))
    # the paper's held-out change on that seed at its last step is -its gain
    paired_held = [0.5 * reads[s] + paper_final[s][1] for s in (0, 1)]
    assert out["cheap"]["heldout_vs_reference"][0] == pytest.approx(np.mean(paired_held))
    assert out["cheap"]["extrapolated_gain"] == 0 and out["cheap"]["extrapolated_drift"] == 0
    # the reference read at its own point gives its own mean back when its seeds agree in drift (here: within
    # interpolation of each seed's path at the mean drift)
    assert list(out) == ["paper", "cheap"]


def test_the_reference_needs_its_rows_and_step():
    with pytest.raises(ValueError, match="reference"):
        equal_drift(_rows("cheap", 0, {5: (0.1, 0.01, 0.0)}))
    with pytest.raises(ValueError, match="no evaluated step 7"):
        equal_drift(_rows("paper", 0, {5: (0.1, 0.01, 0.0)}), ref_steps=7)


def test_a_curve_that_ends_below_zero_never_reaches_a_positive_gain():
    path = [(0.0, 0.0), (0.05, 0.01), (0.09, -0.004)]  # (drift, gain): the gain fell below zero
    value, ext = read_along(path, 1, 0, 0.02)
    assert ext and math.isnan(value)
    rows = _rows("paper", 0, {5: (0.05, 0.02, 0.0)}) + _rows("paper", 1, {5: (0.05, 0.02, 0.0)})
    rows += _rows("x", 0, {5: (0.05, 0.01, 0.0), 10: (0.09, -0.004, 0.0)}) + _rows("x", 1, {5: (0.04, 0.04, 0.0)})
    out = {r["recipe"]: r for r in equal_drift(rows)}
    assert out["x"]["unreached_drift"] == 1
    assert out["x"]["drift_at_ref_gain"][0] == pytest.approx(0.02)  # seed 1 alone, between (0, 0) and (0.04, 0.04)
