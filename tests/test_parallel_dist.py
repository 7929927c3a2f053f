"""The process mesh and the data-parallel/sequence-parallel plumbing of the loop on 4 gloo ranks (dp 2 x sp 2): one
launch of tests/dist_workers/mesh_worker.py, read by the first two tests."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mesh_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("mesh")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                        str(ROOT / "tests/dist_workers/mesh_worker.py"), str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads((out / f"rank{i}.json").read_text()) for i in range(4)]


@pytest.mark.dist
def test_mesh_groups_metrics_and_sp_split_scoring(mesh_ranks):
    ranks = mesh_ranks
    for r in ranks:
        # contiguous sp groups (rank = dp_rank * sp + sp_rank); dp groups join the ranks with the same sp_rank
        assert (r["dp_rank"], r["sp_rank"]) == divmod(r["rank"], 2)
        assert r["sp_group"] == [2 * r["dp_rank"], 2 * r["dp_rank"] + 1]
        assert r["dp_group"] == [r["sp_rank"], r["sp_rank"] + 2]
        # HSDP: 2 replicas of a shard group over (dp_shard x sp) = 2 ranks
        assert r["fsdp_mesh"] == [[0, 1], [2, 3]]
        # each key averaged over the ranks that report it: all (0+1+2+3)/4, odd (10+30)/2
        assert r["metrics"] == {"all": 1.5, "odd": 20.0}
        # without FSDP2: gradients summed over all 4 ranks (sp partials add) and divided by dp = 2: (1+2+3+4)/2
        assert r["synced"] == [[5.0] * 3, [0.0] * 2]
        assert r["synced_fsdp"] == [r["rank"] + 1.0] * 3
        # every sp peer ends with the scores of all 3 videos of its dp rank, in order; each video was scored once
        # per sp group: 3 = 2 + 1 across the two peers
        expected = [(i / 10 + r["dp_rank"]) if i / 10 + r["dp_rank"] <= 1 else 1.0 for i in range(3)]
        assert r["names"] == ["bright", "total"]
        assert [row[1] for row in r["scores"]] == pytest.approx(expected, abs=1e-6)
    for dp in (0, 1):
        assert sorted(r["scored"] for r in ranks if r["dp_rank"] == dp) == [1, 2]


@pytest.mark.dist
def test_fsdp_mesh_without_replication(mesh_ranks):
    """dp_replicate 1 (plain FSDP over dp_shard x sp): one flat mesh of the 4 ranks."""
    assert all(r["fsdp_mesh_no_replication"] == [0, 1, 2, 3] for r in mesh_ranks)


def test_multinode_launcher_refuses_missing_variables(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR")}
    r = subprocess.run(["bash", str(ROOT / "run_post_train_multinode.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "set NNODES NODE_RANK MASTER_ADDR" in r.stderr
    r = subprocess.run(["bash", str(ROOT / "run_post_train_multinode.sh")], capture_output=True, text=True,
                       env={**env, "NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "x"})
    assert r.returncode == 2 and "NODE_RANK 2 must be below NNODES 2" in r.stderr
