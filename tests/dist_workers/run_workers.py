"""torchrun entry that runs several of the worker scripts beside it one after the other in one launch, so a test
module pays torchrun's and the imports' start-up once instead of once per worker (about 13 CPU seconds on the 2-core
machine for each launch saved). argv[1]: a JSON file holding a list of [worker, its arguments...], a worker being a
file name beside this one or the path of a script (generate.py). Before each worker it prints `== worker <i>` so a
test can split the launch's output.

Each worker runs as `__main__` with its own sys.argv. They share the launch's default process group: the first
worker's `init_distributed` creates it, the later ones find it (and build their own meshes on it), and the workers'
own `destroy_process_group` is held back until the last one is done, since gloo does not reliably come back from
destroy + init in one torchrun worker (tests/dist_workers/post_train_runs_worker.py says how it hangs)."""

import json
import runpy
import sys
from pathlib import Path

import torch.distributed as dist

HERE = Path(__file__).resolve().parent

destroy = dist.destroy_process_group
dist.destroy_process_group = lambda *a, **k: None  # the workers call it through the module at their end
try:
    for i, (name, *args) in enumerate(json.loads(Path(sys.argv[1]).read_text())):
        path = HERE / name  # an absolute path stays itself
        print(f"== worker {i}", flush=True)
        sys.argv = [str(path), *map(str, args)]
        runpy.run_path(str(path), run_name="__main__")
        sys.stdout.flush()  # this worker's output reaches the pipe before any rank prints the next marker
        dist.barrier()  # every rank done with this worker before any starts the next
finally:
    destroy()
