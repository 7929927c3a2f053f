#!/usr/bin/env bash
# Shared set-up for scripts/demo.sh and scripts/test.sh: a .venv inside the repository with the package installed.
# Usage: source scripts/_setup.sh "extra1,extra2"
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-}"
venv="${SAGE_GRPO_VENV:-$repo/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
py="$venv/bin/python"
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] GPU found: installing the default torch build"
    "$py" -m pip install -q "torch>=2.9"  # pyproject.toml's floor (torch.optim.Muon)
  else
    # An unpinned torch resolves to a multi-GB CUDA build; 2.13.0 is the CPU wheel these machines carry.
    echo "[setup] no GPU: installing torch==2.13.0 (CPU)"
    "$py" -m pip install -q "torch==2.13.0"
  fi
fi
# The stamp records the pyproject digest and every extra installed so far, so demo.sh and test.sh (different
# extras) do not reinstall each other; a changed pyproject.toml reinstalls with the union of the extras.
stamp="$venv/.sage_grpo_installed"
digest="$(sha1sum < "$repo/pyproject.toml" | cut -c1-12)"
have_digest="" have_extras=""
[ -f "$stamp" ] && read -r have_digest have_extras < "$stamp"
[ "$have_digest" = "$digest" ] || have_extras=""
all="$(printf '%s\n' ${have_extras//,/ } ${extras//,/ } | sort -u | paste -sd, -)"
if [ "$have_digest" != "$digest" ] || [ "$all" != "$have_extras" ]; then
  echo "[setup] installing sage-grpo [${all}]"
  spec="$repo"
  [ -n "$all" ] && spec="$repo[$all]"
  "$py" -m pip install -q -e "$spec"
  echo "$digest $all" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
export PYTHON="$py"
