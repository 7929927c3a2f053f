#!/usr/bin/env bash
# The test command of the README: set up .venv (torch CPU wheel when there is no GPU), lint, then every test that
# runs on a CPU (the fast default suite, the slow and the multi-process torchrun/gloo tests) in one pytest run spread
# over the cores by pytest-xdist (one worker more than cores), a whole file at a time per worker (module fixtures
# built once) and one torch thread each; the longest files start first (tests/conftest.py). Prints the 15 slowest tests and the total time.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS
source scripts/_setup.sh "dev,lora,plot,serve"
echo "== ruff"
ruff check .
echo "== pytest (every CPU test: fast, slow and multi-process)"
# one worker more than cores: many tests wait on subprocesses (torchrun rendezvous, a reward server, signals), and
# the extra worker runs while they wait (measured: 87 s of such waits in a 2-worker run)
workers=$(( $(nproc) + 1 ))
OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider -m "" -n "$workers" --dist loadfile --no-loadscope-reorder \
  --durations=15
echo "== all tests passed; scripts/test.sh took $((SECONDS - start)) s (set-up included)"
