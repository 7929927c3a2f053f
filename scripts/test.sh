#!/usr/bin/env bash
# The test command of the README. Sets up .venv (torch CPU wheel when there is no GPU), runs ruff, then:
#   bash scripts/test.sh         the fast tier: every test without a tier marker (each module's unit tests and one
#                                end-to-end run per entry point and capability), minutes on 2 cores;
#   bash scripts/test.sh --all   the full tier, what CI runs: the fast tier plus the `slow` and the multi-process
#                                `dist` tests (torchrun/gloo, the real one-node SLURM) in one pytest run, then the
#                                judge's tests against a real vLLM server (scripts/vllm_tests.sh, which installs
#                                vLLM's CPU build into .venv-vllm when it is missing).
# Extra arguments go to pytest. One pytest run is spread over the cores by pytest-xdist (a worker per core), a whole
# file at a time per worker (module fixtures built once) and one torch thread each; the longest files start first
# (tests/conftest.py). Prints the 15 slowest tests and the total time (docs/development.md#tests says why).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS
tier="fast" markers="not slow and not dist and not vllm"
if [ "${1:-}" = "--all" ]; then
  tier="full" markers="not vllm"
  shift
fi
source scripts/_setup.sh "dev,lora,plot,serve,judge"
echo "== ruff"
ruff check .
echo "== pytest, the $tier tier (-m \"$markers\")"
# A torchrun test whose gloo rank aborts at process exit ("terminate called without an active exception", after its
# results are written and the ranks passed a barrier; seen twice in about ten full runs on 2 loaded cores) runs
# once more; any other failure fails the run.
OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider -m "$markers" -n auto --dist loadfile --no-loadscope-reorder \
  --durations=15 --reruns 1 --only-rerun "terminate called without an active exception" "$@"
if [ "$tier" = "full" ]; then
  echo "== the judge against a real vLLM server (scripts/vllm_tests.sh)"
  bash scripts/vllm_tests.sh
fi
echo "== all tests of the $tier tier passed; scripts/test.sh took $((SECONDS - start)) s (set-up included)"
