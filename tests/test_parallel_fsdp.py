"""FSDP2 on 2 gloo ranks (sage_grpo/parallel/fsdp.py, sage_grpo/parallel/muon.py): training steps equal one process,
ShardedMuon equals torch.optim.Muon, the gradient divide factor under sp / HSDP, meta-device loading of each rank's
rows, the sharded anchor's local refresh, DCP round trips (2 ranks -> 2 ranks, 2 ranks -> 1 process).

Each test is one torchrun launch of a worker under tests/dist_workers/ that checks several cases and writes the
numbers; the tolerances are asserted here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _launch(worker: str, tmp_path, *args) -> list[dict]:
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(ROOT / "tests/dist_workers" / worker), str(tmp_path), *map(str, args)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]


@pytest.mark.dist
def test_fsdp_step_equals_one_process(tmp_path):
    ranks = _launch("fsdp_step_worker.py", tmp_path)
    for r in ranks:
        # AdamW, 2 updates, gradient checkpointing, clipping at 0.05 (it clips: norms ~2.5): gradients and parameters
        # equal the one-process run on the same 4 samples to fp32 reduction-order noise
        a = r["adamw"]
        for s in (0, 1):
            assert a[f"grad_diff_{s}"] <= 1e-6 * max(1.0, a[f"grad_max_{s}"])
            n, n_ref = a[f"norm_{s}"]
            assert n == pytest.approx(n_ref, rel=1e-6) and n_ref > 0.05
            assert a[f"clipped_grad_diff_{s}"] <= 1e-7
            assert a[f"param_diff_{s}"] <= 1e-6 and a[f"param_moved_{s}"] > 1e-3  # the step moved the weights
        # Muon + AdamW through build_optimizer: the sharded run uses ShardedMuon; given the sharded run's gradients
        # the one-process torch.optim.Muon + AdamW update is bitwise the same
        m = r["muon"]
        assert m["muon_class"] == "ShardedMuon"
        for s in (0, 1):
            assert m[f"grad_diff_{s}"] <= 1e-6 * max(1.0, m[f"grad_max_{s}"])
            assert m[f"param_diff_{s}"] == 0.0 and m[f"param_moved_{s}"] > 1e-3
        # ShardedMuon alone on the same gradients, 3 steps, uneven / empty row shards, tall and wide matrices:
        # bitwise equal to torch.optim.Muon, momentum buffers included; FSDP (Shard(0)) and HSDP (Replicate, Shard(0))
        assert r["muon_exact_fsdp"] is True
        assert r["muon_exact_hsdp"] is True
        # gradient = sum over sp peers, mean over dp: dp 2 (sp 1), sp 2 (dp 1), HSDP 2 replicas; weights untouched
        for layout, (err, scale, untouched) in r["divide"].items():
            assert err <= 1e-6 * scale, layout
            assert untouched, layout
