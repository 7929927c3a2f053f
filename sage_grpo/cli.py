"""Shared pieces of the command-line scripts: an argparse whose errors are one `error:` line, output-path checks
made before any model loads, and quiet third-party logging unless `--verbose`."""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import typing
import warnings
from pathlib import Path

from sage_grpo.errors import SageGRPOError

__all__ = ["CLIParser", "finite_float", "check_writable_dir", "check_output_file", "quiet_libraries", "show_progress",
           "at_least"]


class CLIParser(argparse.ArgumentParser):
    """argparse whose usage errors raise SageGRPOError, so `run_cli` prints one `error: ...` line and exits 2
    (plain argparse prints the whole usage block first). `--help` still prints and exits 0."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # --out must not silently mean --output_path
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        if kwargs.get("type") is float:  # nan and inf parse as floats but are never a meaningful setting
            kwargs["type"] = finite_float
        return super().add_argument(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        raise SageGRPOError(message)


def finite_float(text: str) -> float:
    """argparse type: a float that is not nan or +-inf (every float flag of our scripts goes through it)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def at_least(flag: str, value: float, low: float, *, strict: bool = False) -> None:
    """`--flag` must be >= low (> low with strict)."""
    if value < low or (strict and value == low):
        raise SageGRPOError(f"{flag} must be {'>' if strict else '>='} {low:g}, got {value:g}")


def check_writable_dir(directory: str | Path, flag: str, create: bool = True) -> Path:
    """Create `directory` (and parents) and prove a file can be written in it; a parent that is a file, a read-only
    or virtual file system (/proc) or missing permissions become one message naming `flag`. Call before any model
    loads, so that minutes of sampling are never lost to an unwritable output. create False: a missing `directory`
    is not made (a command that fails later leaves no empty folder): the probe is written in its nearest existing
    ancestor, and the writer makes the folder once the work starts."""
    d = Path(directory)
    probe = d
    while not probe.exists() and probe != probe.parent:  # the nearest existing ancestor
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise SageGRPOError(f"{flag} {directory}: {probe} is a file, not a folder; choose another path")
    try:
        if create:
            d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d if create else probe, prefix=".write_probe_"):
            pass
    except OSError as err:
        raise SageGRPOError(f"{flag} {directory} is not writable ({err.strerror or err}); choose another "
                            "path") from None
    return d


def check_output_file(path: str | Path, flag: str, create: bool = True) -> Path:
    """The folder of `path` is writable (made unless create is False: check_writable_dir) and `path` itself is not a
    folder."""
    p = Path(path)
    if p.is_dir():
        raise SageGRPOError(f"{flag}: {p} is a folder; give a file name")
    check_writable_dir(p.parent, flag, create)
    return p


def quiet_libraries(verbose: bool = False) -> None:
    """Silence diffusers' and transformers' warnings (e.g. "Guiders are ... experimental", load-report tables) and
    progress bars unless `verbose`; errors still show. Call before loading models."""
    if verbose:
        return
    # DCP saving or loading in one process warns on every call, with a dangling source line after it
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    try:
        from diffusers.utils import logging as dlog

        dlog.set_verbosity_error()
        dlog.disable_progress_bar()
    except ImportError:
        pass
    try:
        from transformers.utils import logging as tlog

        tlog.set_verbosity_error()
        tlog.disable_progress_bar()
    except ImportError:
        pass


def show_progress(verbose: bool = False) -> bool:
    """Progress bars only on an interactive terminal (tqdm's redraws fill non-interactive logs), or with --verbose."""
    return verbose or sys.stderr.isatty()
