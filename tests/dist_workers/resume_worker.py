"""torchrun worker (2 gloo ranks) for tests/test_launch.py: the process-group timeout comes from the flag, and
`--resume_from_checkpoint` is resolved once on rank 0 and broadcast (rank 1 is given a stale directory listing).
Writes rank{r}.json to argv[1]; argv[2] is a run folder with checkpoint-1 and checkpoint-2."""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import sage_grpo.checkpoint as ck  # noqa: E402
from sage_grpo.errors import SageGRPOError  # noqa: E402
from sage_grpo.parallel.dist import barrier, destroy, init_distributed  # noqa: E402

spec = importlib.util.spec_from_file_location("post_train", ROOT / "post_train.py")
pt = importlib.util.module_from_spec(spec)
sys.modules["post_train"] = pt
spec.loader.exec_module(pt)

out, run = Path(sys.argv[1]), Path(sys.argv[2])
info = init_distributed(timeout_minutes=77)
res = {"timeout_s": torch.distributed.distributed_c10d._get_default_group()._get_backend(
    torch.device("cpu")).options._timeout.total_seconds()}
if info.rank == 1:  # a node whose listing of the shared filesystem is stale: it sees only checkpoint-1
    listing = ck.list_checkpoints(run)
    ck.list_checkpoints = lambda d: listing[:1]


def cfg(spec: str):
    return SimpleNamespace(checkpoint=SimpleNamespace(resume_from_checkpoint=spec, output_dir=str(run)))


res["latest"] = str(pt.agreed_resume(cfg("latest"), info))
res["local_latest"] = str(ck.resolve_resume("latest", run))  # what this rank alone would have loaded
try:
    pt.agreed_resume(cfg(str(run / "checkpoint-9")), info)
except SageGRPOError as e:
    res["error"] = str(e)
(out / f"rank{info.rank}.json").write_text(json.dumps(res))
barrier()
destroy()
