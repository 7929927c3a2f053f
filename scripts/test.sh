#!/usr/bin/env bash
# The test command of the README: set up .venv (torch CPU wheel when there is no GPU), lint, then every test that
# runs on a CPU: the fast default suite, then the slow and multi-process (torchrun/gloo) tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_setup.sh "dev,lora,plot,serve"
echo "== ruff"
ruff check .
echo "== pytest (fast suite)"
python -m pytest -q -p no:cacheprovider
echo "== pytest (slow and dist)"
set +e
python -m pytest -q -p no:cacheprovider -m "slow or dist" --durations=15
rc=$?
set -e
# exit 5 = nothing collected for this marker, which is not a failure
if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
echo "== all tests passed"
