"""scripts/bench_reward_balance.py: its statistics against numpy, its user errors, and (slow) its --quick run on the
tiny world model end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import load_script

from sage_grpo.errors import SageGRPOError

ROOT = Path(__file__).resolve().parents[1]


rb = load_script("scripts/bench_reward_balance.py", register=True)


def test_aggregate_equals_numpy_over_seeds():
    rng = np.random.default_rng(0)
    comps = ["a", "b"]
    base = {"a": {"mean": 0.3, "std": 0.05}, "b": {"mean": -0.03, "std": 0.002}}
    after = {c: {k: rng.normal(base[k]["mean"], 0.02, 3) for k in comps} for c in rb.COMBINES}
    runs = [{"combine": c, "seed": s, "after": {k: float(after[c][k][s]) for k in comps}}
            for s in range(3) for c in rb.COMBINES]  # the script's order: seeds outermost
    table = rb.aggregate(runs, base, comps)
    for k in comps:
        changes = {}
        for c in rb.COMBINES:
            change = after[c][k] - base[k]["mean"]
            got = table[c][k]
            assert got["change"]["mean"] == pytest.approx(change.mean())
            assert got["change"]["se"] == pytest.approx(change.std(ddof=1) / math.sqrt(3))
            assert got["change"]["median"] == pytest.approx(np.median(change))
            assert got["spreads"]["mean"] == pytest.approx(change.mean() / base[k]["std"])
            assert got["spreads"]["se"] == pytest.approx(change.std(ddof=1) / math.sqrt(3) / base[k]["std"])
            assert list(got["per_seed"].values()) == pytest.approx(change.tolist())
            changes[c] = change
        d = table["component_norm - weighted_sum"][k]["change"]
        se = math.sqrt(changes["weighted_sum"].var(ddof=1) / 3 + changes["component_norm"].var(ddof=1) / 3)
        assert d["diff"] == pytest.approx(changes["component_norm"].mean() - changes["weighted_sum"].mean())
        assert d["se"] == pytest.approx(se)
        assert d["std_errors"] == pytest.approx(d["diff"] / se)
    text = rb.format_table(table, base, comps)
    assert len(text.splitlines()) == 2 + 4 + 2 and "nan" not in text


def test_within_group_stats_equal_numpy_per_group():
    rng = np.random.default_rng(1)
    a = rng.normal(0.3, 0.05, (5, 4))  # [groups, G]
    b = -0.1 * a + rng.normal(0, 0.002, (5, 4))
    b[2] = 0.5  # a constant component: no correlation in that group
    got = rb.within_group_stats({"a": a.ravel().tolist(), "b": b.ravel().tolist()}, 4)
    assert got["groups"] == 5
    assert got["std"]["a"] == pytest.approx(a.std(axis=1).mean())
    assert got["std"]["b"] == pytest.approx(b.std(axis=1).mean())
    corr = [np.corrcoef(a[g], b[g])[0, 1] for g in (0, 1, 3, 4)]
    assert got["corr"] == pytest.approx(np.mean(corr)) and got["corr"] < -0.5


def test_one_seed_has_no_standard_error():
    one = rb.mean_se([0.25])
    assert one["mean"] == one["median"] == 0.25 and math.isnan(one["se"])


@pytest.mark.parametrize("argv, message", [
    (["--rewards", "world_motion"], "two different reward names"),
    (["--rewards", "world_size,world_size"], "two different reward names"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--eval_noises", "0"], "--eval_noises must be >= 1"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_bad_flags_are_one_error(argv, message, tmp_path):
    with pytest.raises(SageGRPOError, match=message):
        rb.main([*argv, "--out", str(tmp_path / "o")])


def test_missing_config_is_one_error_before_anything_loads(tmp_path):
    with pytest.raises(SageGRPOError, match="is not a file"):
        rb.main(["--config", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "o")])


@pytest.mark.slow
def test_quick_trains_both_combinations_and_scores_them_on_the_same_set(tmp_path, capsys):
    """--quick: one 1-step run per combination on the tiny world model, each evaluated on the same 2 captions; the
    table's numbers are the runs' scores minus the base scores, and each run trained with its combination."""
    import torch

    threads = torch.get_num_threads()
    try:
        summary = rb.main(["--quick", "--out", str(tmp_path / "rb")])
    finally:
        torch.set_num_threads(threads)
    out = tmp_path / "rb"
    assert "bounces" not in (out / "train_prompts.txt").read_text()
    comps = ["world_motion", "temporal_consistency"]
    assert [(r["combine"], r["seed"]) for r in summary["runs"]] == [("weighted_sum", 0), ("component_norm", 0)]
    for k in comps:
        base = summary["base_scores"][k]
        assert len(base) == 2 and all(math.isfinite(v) for v in base)
        assert summary["base"][k]["mean"] == pytest.approx(np.mean(base))
        for run in summary["runs"]:
            assert run["after"][k] == pytest.approx(np.mean(run["scores"][k]))
            assert summary["table"][run["combine"]][k]["change"]["mean"] == pytest.approx(
                run["after"][k] - np.mean(base))
    spreads = summary["group_spreads"]
    assert spreads["groups"] == 2 and all(spreads["std"][k] > 0 for k in comps) and -1 <= spreads["corr"] <= 1
    for run in summary["runs"]:
        run_dir = out / "runs" / f"{run['combine']}_s0"
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert cfg["reward"]["reward_combine"] == run["combine"]
        assert json.loads(cfg["reward"]["reward_weights"]) == {k: 1.0 for k in comps}
        assert not list(run_dir.glob("checkpoint-*"))  # deleted once evaluated
    assert (out / "table.md").read_text().strip() in capsys.readouterr().out
