#!/usr/bin/env bash
# The test command of the README: set up .venv (torch CPU wheel when there is no GPU), lint, then every test that
# runs on a CPU (the fast default suite, the slow and the multi-process torchrun/gloo tests) in one pytest run spread
# over the cores by pytest-xdist (a worker per core), a whole file at a time per worker (module fixtures built once)
# and one torch thread each; the longest files start first (tests/conftest.py). Prints the 15 slowest
# tests and the total time (docs/development.md#tests says why each choice).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS
source scripts/_setup.sh "dev,lora,plot,serve,judge"
echo "== ruff"
ruff check .
echo "== pytest (every CPU test: fast, slow and multi-process; the vLLM tests are scripts/vllm_tests.sh's)"
# A torchrun test whose gloo rank aborts at process exit ("terminate called without an active exception", after its
# results are written and the ranks passed a barrier; seen twice in about ten full runs on 2 loaded cores) runs
# once more; any other failure fails the run.
OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider -m "not vllm" -n auto --dist loadfile --no-loadscope-reorder \
  --durations=15 --reruns 1 --only-rerun "terminate called without an active exception"
echo "== all tests passed; scripts/test.sh took $((SECONDS - start)) s (set-up included)"
