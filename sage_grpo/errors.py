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
    the message also goes to torchelastic's error file, so the launcher (`sage_grpo.launch`) can end with it; under
    that launcher the worker prints nothing itself: the launcher's last line is the error, once, not once per rank."""
    try:
        return main(*args, **kwargs)
    except SageGRPOError as e:
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if not (error_file and os.environ.get("SAGE_GRPO_STOP_FILE")):  # set by sage_grpo.launch for its workers
            print(f"error: {e}", file=sys.stderr)
        if error_file:
            with open(error_file, "w") as f:  # torchelastic's plain-message form: {"message": str, "timestamp"}
                json.dump({"message": str(e), "timestamp": int(time.time())}, f)
        sys.exit(2)
