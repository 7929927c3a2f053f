"""scripts/demo_compare.py's statistics against numpy: the rollout windows and the paired before/after change."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import demo_compare  # noqa: E402

from sage_grpo.errors import SageGRPOError  # noqa: E402


def test_paired_stats_equal_a_paired_t_statistic():
    rng = np.random.default_rng(0)
    before = rng.normal(0.3, 0.1, 12)
    after = before + rng.normal(0.05, 0.02, 12)
    got = demo_compare.paired_stats(before.tolist(), after.tolist())
    d = after - before
    assert got["paired_change"] == pytest.approx(d.mean())
    assert got["paired_std_errors"] == pytest.approx(d.mean() / (d.std(ddof=1) / math.sqrt(len(d))))
    # the pairing matters: the unpaired spread of `before` (0.1) would give a far smaller statistic
    assert got["paired_std_errors"] > 3 * d.mean() / math.sqrt(before.var(ddof=1) / 12 + after.var(ddof=1) / 12)
    assert demo_compare.paired_stats([0.0, 1.0], [0.5, 1.5])["paired_std_errors"] == math.inf
    assert math.isnan(demo_compare.paired_stats([0.1, 0.2], [0.1, 0.2])["paired_std_errors"])
    assert math.isnan(demo_compare.paired_stats([0.1], [0.3])["paired_std_errors"])


def test_learning_stats_compare_the_first_and_last_windows(tmp_path):
    rng = np.random.default_rng(1)
    r = np.concatenate([rng.normal(0.2, 0.05, 15), rng.normal(0.3, 0.05, 15)])
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": i + 1, "reward/total_mean": float(v)} for i, v in enumerate(r)] + [{"step": 30, "val/x": 1.0}]
    path.write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    got = demo_compare.learning_stats(path, window=10)
    first, last = r[:10], r[-10:]
    se = math.sqrt(first.var(ddof=1) / 10 + last.var(ddof=1) / 10)
    assert got["steps"] == 30
    assert got["std_errors"] == pytest.approx((last.mean() - first.mean()) / se)
    with pytest.raises(SageGRPOError, match="at least 40"):
        demo_compare.learning_stats(path, window=20)


@pytest.mark.parametrize("flags", [["--prompts", "0"], ["--strip_prompts", "0"]])
def test_zero_prompts_is_one_error_before_anything_loads(tmp_path, flags):
    with pytest.raises(SageGRPOError, match="must be >= 1"):
        demo_compare.main(["--run", str(tmp_path), "--out", str(tmp_path / "o"), *flags])
