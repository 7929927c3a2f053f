"""scripts/bench_attention.py --backends in its CPU mode: every backend measured in one run, or named with why not."""

from __future__ import annotations

import pytest
from helpers import load_script

ba = load_script("scripts/bench_attention.py")


def test_backends_are_measured_in_one_run_against_native(tmp_path):
    res = ba.main(["--cpu", "--reps", "1", "--backends", "_native_math,flash", "--out", str(tmp_path)])
    rows = {r["backend"]: r for r in res["backends"]}
    assert list(rows) == ["native", "_native_math", "flash"]  # native first: the reference
    for name in ("native", "_native_math"):
        r = rows[name]
        assert r["runs"] and r["forward_tflops"] > 0 and r["fwdbwd_tflops"] > 0
        # TFLOP/s are the FLOP model's over the measured time
        assert r["forward_tflops"] == pytest.approx(res["backends"][0]["forward_tflops"] * rows["native"]["forward_ms"]
                                                    / r["forward_ms"])
        assert r["out_max_abs_diff_vs_native"] <= 1e-5
    assert not rows["flash"]["runs"] and rows["flash"]["reason"].startswith("not installed")
    assert (tmp_path / "bench_attention.json").is_file()
