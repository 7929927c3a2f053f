"""End-to-end smoke test of scripts/lab_ablation.py (slow: it pre-trains a flow and spawns a worker)."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "lab_ablation.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("lab_ablation", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parse_args_quick_defaults():
    args = _load_script().parse_args(["--quick"])
    assert (args.seeds, args.dims, args.iterations) == (3, [2], 30)
    args = _load_script().parse_args([])
    assert (args.seeds, args.dims, args.iterations) == (5, [2, 16], 60)


@pytest.mark.slow
def test_ablation_script_writes_table_csv_and_cache(tmp_path, capsys):
    mod = _load_script()
    argv = ["--seeds", "2", "--dims", "2", "--iterations", "2", "--samplers", "sage_grpo", "--kls", "none", "dual",
            "--workers", "1", "--no-plots", "--out", str(tmp_path)]
    assert mod.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| Pre-trained flow |" in printed and "| sage_grpo | on | dual |" in printed
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert len(rows) == 2 * 2 * 2  # seeds x equalizer x KL
    assert sorted({r["seed"] for r in rows}) == ["0", "1"]
    cache = sorted(p.name for p in (tmp_path / "base").iterdir())
    assert cache == ["flow_d2_s0.pt", "flow_d2_s1.pt"]
    mtimes = [p.stat().st_mtime_ns for p in (tmp_path / "base").iterdir()]
    assert mod.main(argv) == 0  # second run reuses the cached base models
    assert [p.stat().st_mtime_ns for p in (tmp_path / "base").iterdir()] == mtimes
    assert (tmp_path / "table_d2.md").read_text().startswith("| Method |")


@pytest.mark.slow
def test_recipes_table_reports_flops_forwards_and_equal_drift(tmp_path, capsys):
    """--recipes: the recipes an unconditional model can run, their model FLOPs by phase and counted forwards
    against the paper's recipe, the gains as mean ± standard error over seeds (recomputed here from summary.csv),
    and each recipe read at the paper recipe's drift along its evaluations (points.csv), with the figure."""
    import statistics

    from sage_grpo.lab.equal_drift import equal_drift

    mod = _load_script()
    assert mod.main(["--recipes", "--seeds", "2", "--dims", "2", "--iterations", "6", "--workers", "1", "--out",
                     str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert sorted({r["recipe"] for r in rows}) == ["paper", "sliding", "sliding_shared", "window"]
    table = (tmp_path / "recipes.md").read_text()
    fwd = {r["recipe"]: float(r["forwards_per_sample_iter"]) for r in rows if r["seed"] == "0"}
    assert fwd["window"] < fwd["paper"] and fwd["sliding_shared"] < fwd["sliding"]  # the prefix runs once per group
    flop = {name: statistics.mean(float(r["flop_iter"]) for r in rows if r["recipe"] == name) for name in fwd}
    for r in rows:  # the total is the three phases
        assert float(r["mflop_step"]) * 1e6 == pytest.approx(sum(float(r[f"flop_{k}_iter"])
                                                                  for k in ("rollout", "anchor", "update")))
    gains = [float(r["gain_reward"]) for r in rows if r["recipe"] == "window"]
    mean, se = statistics.mean(gains), statistics.stdev(gains) / 2**0.5
    line = next(x for x in table.splitlines() if x.startswith("| window | 6 |"))
    assert f"{mean:.3f} ± {se:.3f}" in line and f"| {flop['window'] / flop['paper']:.2f} |" in line
    assert f"| {fwd['window']:.2f} |" in line
    # the equal-drift table: the paper's recipe at its 6 iterations, every recipe through its iterations 5 and 6
    points = list(csv.DictReader((tmp_path / "points.csv").open()))
    assert sorted({int(p["steps"]) for p in points}) == [5, 6] and len(points) == 2 * 4 * 2
    got = next(r for r in equal_drift(points, "paper", ref_steps=6) if r["recipe"] == "sliding")
    drift_line = next(x for x in table.split("at equal drift")[1].splitlines() if x.startswith("| sliding |"))
    assert f"{got['gain_at_ref_drift'][0]:.3f} ± {got['gain_at_ref_drift'][1]:.3f}" in drift_line
    assert (tmp_path / "equal_drift_d2.png").stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0"], "--seeds must be >= 1"),  # was silently 5 (`args.seeds or 5`)
    (["--iterations", "0"], "--iterations must be >= 1"),  # was silently 60
    (["--workers", "0"], "--workers must be >= 1"),
    (["--dims", "1"], "--dims must be >= 2"),
    (["--seeds", "x"], "invalid int value"),
])
def test_bad_values_are_one_error_not_the_default(argv, message):
    from sage_grpo.errors import SageGRPOError

    with pytest.raises(SageGRPOError, match=message):
        _load_script().parse_args(argv)


def test_help_names_no_internal_issue(capsys):
    with pytest.raises(SystemExit):
        _load_script().parse_args(["--help"])
    assert "issue" not in capsys.readouterr().out.lower()


def test_unwritable_out(tmp_path):
    from sage_grpo.errors import SageGRPOError

    (tmp_path / "f").write_text("")
    with pytest.raises(SageGRPOError, match="is a file, not a folder"):
        _load_script().main(["--out", str(tmp_path / "f" / "lab"), "--quick"])
