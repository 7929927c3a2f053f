"""torchrun for the launch scripts, ending the way a scheduler and a person read it.

`python -m sage_grpo.launch <torchrun arguments> post_train.py <flags>` runs torch's own launcher
(`torch.distributed.run.run`) and changes only how it ends:
- a stop signal (SIGTERM from SLURM or Kubernetes, Ctrl-C) after which the workers saved their checkpoint ends with
  exit 0 (torchrun raises SignalException and exits 1 with a traceback, so a clean pre-emption read as a failure);
  post_train.py's rank 0 prints the one "stopped after step N; checkpoint-N is saved" line, each node's local rank 0
  marks the clean stop in the file named by SAGE_GRPO_STOP_FILE;
- a worker that failed with a user error ends with that error's one line (which `sage_grpo.errors.run_cli` writes
  to torchelastic's error file) and its exit code, instead of torchrun's ChildFailedError traceback.
Everything else (rendezvous, restarts, the shutdown timeout) is torchrun's.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

STOP_FILE_ENV = "SAGE_GRPO_STOP_FILE"


def main(argv: list[str] | None = None) -> int:
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    tmp = Path(tempfile.mkdtemp(prefix="sage_grpo_launch_"))
    stop_file = tmp / "stopped"
    os.environ[STOP_FILE_ENV] = str(stop_file)  # the workers inherit the launcher's environment
    try:
        torchrun.run(torchrun.parse_args(argv))
    except SignalException as e:
        if stop_file.is_file():
            return 0  # the workers finished their step and saved: a clean stop
        name = signal.Signals(e.sigval).name
        print(f"error: {name} before the workers saved a checkpoint; the newest complete checkpoint is what "
              "--resume_from_checkpoint latest continues from", file=sys.stderr)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = _first_own_failure(e.failures)
        message = failure.message if isinstance(failure.message, str) else ""
        if not message or "elastic/errors.html" in message:  # no user error recorded: a crash or a signal
            message = f"worker rank {rank} failed with exit code {failure.exitcode} (its output is above)"
        print(f"error: {message}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _first_own_failure(failures: dict) -> tuple[int, object]:
    """The earliest worker that failed by itself (exit code > 0), before those torchrun terminated (exit code < 0).

    torchrun's `get_first_failure` takes the smallest timestamp, but a worker it SIGTERMed after a peer's error has no
    error file and gets the current second as its timestamp: on a tie (or a slow error-file write) the failure
    reported was "Signal 15 (SIGTERM)" with exit 1 instead of the peer's user error and its exit code 2."""
    return min(failures.items(), key=lambda kv: (kv[1].exitcode <= 0, kv[1].timestamp, kv[0]))


if __name__ == "__main__":
    sys.exit(main())
