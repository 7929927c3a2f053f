"""User errors and the CLI wrapper that turns them into one clear message and a non-zero exit."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any


class SageGRPOError(Exception):
    """A user error: the message says what to change."""


def run_cli(main: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call an entry point; a SageGRPOError ends the process with `error: <message>` and exit code 2. Under torchrun
    the message also goes to torchelastic's error file, so the launcher (`sage_grpo.launch`) can end with it."""
    try:
        return main(*args, **kwargs)
    except SageGRPOError as e:
        print(f"error: {e}", file=sys.stderr)
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            with open(error_file, "w") as f:  # torchelastic's plain-message form: {"message": str, "timestamp"}
                json.dump({"message": str(e), "timestamp": int(time.time())}, f)
        sys.exit(2)
