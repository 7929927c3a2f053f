import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_plot_script_prints_tables_and_writes_pngs(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/plot_sde.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, check=True)
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith(("0 ", "19 "))]
    std0, std19 = [float(x) for x in rows[0][2:]], [float(x) for x in rows[1][2:]]  # first table: std
    assert std0 == pytest.approx([.556, .500, .051, .700], abs=6e-4)  # README "The samplers", step 0
    assert std19 == pytest.approx([.080, .117, .228, 0.0], abs=6e-4)
    s0, s19 = [float(x) for x in rows[2][2:]], [float(x) for x in rows[3][2:]]  # second table: S_t
    # sage_grpo, the equalizer weights of README "The rest of the algorithm"
    assert (s0[0], s19[0]) == (pytest.approx(8.15, abs=6e-3), pytest.approx(.055, abs=6e-4))
    for name in ("sde_std.png", "equalizer_weights.png", "gradient_scale.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_script_bad_flags_give_one_message():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/plot_sde.py"), "--steps", "0", "--no-plots"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_plot_script_refuses_a_silent_sage_schedule_with_the_shared_message():
    # 84 steps with shift 4: sigma_1 = 1 - 1/333 is within 9e-6 of the 0.997 clamp and step 0's integral is < 0
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/plot_sde.py"), "--steps", "84", "--shift", "4",
                           "--no-plots"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "sage_grpo step 0" in proc.stderr and "would inject no noise" in proc.stderr
    assert "fewer steps (at most 83 with shift 4)" in proc.stderr


def _load():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_sde", ROOT / "scripts/plot_sde.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv, message", [
    (["--eta", "0"], "--eta must be in (0, 1]"),  # every S_t would be 1 and no sampler injects noise
    (["--eta", "1.5"], "--eta must be in (0, 1]"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--shift", "0"], "--shift must be > 0"),
    (["--sage_sigma_clamp", "1"], "--sage_sigma_clamp must be in (0, 1)"),
    (["--steps", "two"], "invalid int value"),
])
def test_plot_flags_each_have_their_own_message(argv, message):
    from sage_grpo.errors import SageGRPOError

    with pytest.raises(SageGRPOError, match=re.escape(message)):
        _load().main([*argv, "--no-plots"])


def test_the_clamp_hint_names_a_flag_the_script_has(capsys):
    """The refusal suggests --sage_sigma_clamp, and plot_sde.py takes it: a clamp closer to 1 allows 100 steps."""
    from sage_grpo.errors import SageGRPOError

    mod = _load()
    with pytest.raises(SageGRPOError, match="--sage_sigma_clamp closer to 1"):
        mod.main(["--steps", "100", "--no-plots"])
    mod.main(["--steps", "100", "--sage_sigma_clamp", "0.99999", "--no-plots"])
    assert "T = 100" in capsys.readouterr().out


def test_zero_variance_step_is_not_plotted():
    mod = _load()
    t = mod.tables(20, 5.0, 0.5)
    assert t["cps"]["std"][-1] == 0 and t["cps"]["N"][-1] == 1.0  # the equalizer's guard value ...
    assert math.isnan(mod.plotted(t, "cps", "N")[-1]) and math.isnan(mod.plotted(t, "cps", "S")[-1])  # ... not drawn
    assert not any(math.isnan(x) for x in mod.plotted(t, "cps", "N")[:-1] + mod.plotted(t, "sage_grpo", "N"))


def test_unwritable_out_is_refused_before_computing(tmp_path):
    from sage_grpo.errors import SageGRPOError

    (tmp_path / "f").write_text("")
    with pytest.raises(SageGRPOError, match="is a file, not a folder"):
        _load().main(["--out", str(tmp_path / "f" / "plots")])
