"""torchrun worker for tests/test_post_train.py: several post_train.py runs (`post_train.main`, the code a torchrun
launch of post_train.py runs) one after the other in one launch, so the 2-rank training tests pay torchrun's and the
imports' start-up once instead of once per run. argv[1]: a JSON file holding a list of runs, each an argument list or
{"argv": [...], "sigterm_in_step": N}: every rank sends itself SIGTERM in the backward pass of step N + 1 (what
torchrun forwards to its workers when the job is stopped), inside the accumulation round that step is.

The runs share the launch's default process group: `main` creates it on the first run (with that run's timeout) and
each run builds its own device mesh on it; the group is destroyed once, after the last run (gloo does not reliably
come back from destroy_process_group + init_process_group in one torchrun worker: the third init hangs)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers import sigterm_in_step  # noqa: E402

import post_train as pt  # noqa: E402
import sage_grpo.parallel.dist as dist_mod  # noqa: E402

destroy = dist_mod.destroy
dist_mod.destroy = lambda: None  # main() imports it from the module at call time
backward = pt.backward_phase
try:
    for run in json.loads(Path(sys.argv[1]).read_text()):
        argv, step = (run["argv"], run["sigterm_in_step"]) if isinstance(run, dict) else (run, None)
        pt.backward_phase = backward if step is None else sigterm_in_step(backward, step)
        pt.main(argv)
        dist_mod.barrier()  # every rank done with this run before any starts the next
finally:
    destroy()
