"""User errors and the CLI wrapper that turns them into one clear message and a non-zero exit."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class SageGRPOError(Exception):
    """A user error: the message says what to change."""


def run_cli(main: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call an entry point; a SageGRPOError ends the process with `error: <message>` and exit code 2."""
    try:
        return main(*args, **kwargs)
    except SageGRPOError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
