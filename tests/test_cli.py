"""sage_grpo.cli: the pieces every script shares."""

import pytest

from sage_grpo.cli import CLIParser, at_least, check_output_file, check_writable_dir, show_progress
from sage_grpo.errors import SageGRPOError


def test_parser_errors_are_sage_errors_and_no_abbreviations():
    p = CLIParser()
    p.add_argument("--output_path")
    p.add_argument("--n", type=int)
    with pytest.raises(SageGRPOError, match="invalid int value"):
        p.parse_args(["--n", "x"])
    with pytest.raises(SageGRPOError, match="unrecognized arguments: --out"):
        p.parse_args(["--out", "a"])


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_float_flags_refuse_non_finite_values(text):
    p = CLIParser()
    p.add_argument("--scale", type=float)
    assert p.parse_args(["--scale", "2.5"]).scale == 2.5
    with pytest.raises(SageGRPOError, match="--scale: must be a finite number"):
        p.parse_args([f"--scale={text}"])


def test_at_least():
    at_least("--a", 1, 1)
    with pytest.raises(SageGRPOError, match="--a must be >= 1, got 0"):
        at_least("--a", 0, 1)
    with pytest.raises(SageGRPOError, match="--b must be > 0, got 0"):
        at_least("--b", 0, 0, strict=True)


def test_writable_checks_can_leave_the_folder_to_the_writer(tmp_path):
    """create=False: the same checks, made without the folder (a command failing later leaves none)."""
    assert check_writable_dir(tmp_path / "a" / "b", "--out", create=False) == tmp_path / "a" / "b"
    assert check_output_file(tmp_path / "c" / "t.csv", "--out", create=False) == tmp_path / "c" / "t.csv"
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_text("")
    with pytest.raises(SageGRPOError, match="is a file, not a folder"):
        check_writable_dir(tmp_path / "f" / "x", "--out", create=False)
    with pytest.raises(SageGRPOError, match="--out /proc/sage_grpo_x is not writable"):
        check_writable_dir("/proc/sage_grpo_x", "--out", create=False)


def test_writable_checks(tmp_path):
    assert check_writable_dir(tmp_path / "a" / "b", "--out").is_dir()
    (tmp_path / "f").write_text("")
    with pytest.raises(SageGRPOError, match="is a file, not a folder"):
        check_writable_dir(tmp_path / "f" / "x", "--out")
    with pytest.raises(SageGRPOError, match="--out /proc/sage_grpo_x is not writable"):
        check_writable_dir("/proc/sage_grpo_x", "--out")
    with pytest.raises(SageGRPOError, match="is a folder; give a file name"):
        check_output_file(tmp_path / "a", "--out")
    assert check_output_file(tmp_path / "c" / "t.csv", "--out").parent.is_dir()


def test_progress_only_on_a_terminal_or_verbose(monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file, not a terminal
    assert show_progress(verbose=True) and not show_progress()
