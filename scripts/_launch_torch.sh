#!/usr/bin/env bash
# Shared by run_post_train.sh and run_post_train_multinode.sh (sourced, after `PY` is set): one Python start for what
# the launch needs from torch (its import is most of the start-up): that it imports, the visible GPU count (->
# visible_gpus) and whether torchrun honours TORCH_ELASTIC_SHUTDOWN_TIMEOUT (torch >= 2.12). Exports the timeout:
# on SIGTERM/SIGINT torchrun forwards the signal and kills the workers after this many seconds; post_train.py needs
# the rest of the current step plus a checkpoint (torch's default is 30 s).
if ! probe=$("$PY" -c "import dataclasses, torch; from torch.distributed.launcher.api import LaunchConfig as L; print(max(torch.cuda.device_count(), 1), int('shutdown_timeout' in {f.name for f in dataclasses.fields(L)}))" 2>/dev/null); then
  echo "$(basename "$0"): $PY cannot import torch: activate the project's environment (source .venv/bin/activate) or set PYTHON=/path/to/python" >&2
  exit 2
fi
read -r visible_gpus shutdown_timeout_ok <<< "$probe"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-1800}"
if [ "$shutdown_timeout_ok" != 1 ]; then
  echo "$(basename "$0"): warning: this torch's torchrun ignores TORCH_ELASTIC_SHUTDOWN_TIMEOUT and kills the workers 30 s after SIGTERM: a stop saves its checkpoint only if the step and the save end within 30 s (torch >= 2.12 waits the full timeout)" >&2
fi
