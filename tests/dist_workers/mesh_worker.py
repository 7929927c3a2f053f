"""torchrun worker for tests/test_parallel_dist.py: the mesh layout, metric reduction, gradient sync without FSDP2
and the sp-split reward scoring of post_train.score_videos, on 4 gloo ranks (dp 2 x sp 2, HSDP with 2 replicas); the
FSDP mesh of the same ranks without replication (a second mesh on the same process group). Writes one JSON per rank
to argv[1]."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import post_train as pt  # noqa: E402
from sage_grpo.parallel.dist import init_distributed, mean_metrics, sync_gradients  # noqa: E402

info = init_distributed(sp_size=2, dp_replicate=2)
out = {"rank": info.rank, "dp_rank": info.dp_rank, "sp_rank": info.sp_rank,
       "sp_group": dist.get_process_group_ranks(info.sp_group), "dp_group": dist.get_process_group_ranks(info.dp_group),
       "fsdp_mesh": info.fsdp_mesh.mesh.tolist(),
       "fsdp_mesh_no_replication": init_distributed(sp_size=2, dp_replicate=1).fsdp_mesh.mesh.tolist()}

# ranks report different keys: each key is averaged over the ranks that have it
out["metrics"] = mean_metrics({"all": float(info.rank), **({"odd": 10.0 * info.rank} if info.rank % 2 else {})})

# rank r holds the partial gradient r + 1 of `a`; `b` got no gradient here (a missing gradient is zeros)
a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
a.grad = torch.full((3,), float(info.rank + 1))
sync_gradients([a, b], info, fsdp=False)
out["synced"] = [a.grad.tolist(), b.grad.tolist()]
a.grad = torch.full((3,), float(info.rank + 1))
sync_gradients([a], info, fsdp=True)  # FSDP2 reduced them in backward: left alone
out["synced_fsdp"] = a.grad.tolist()


class CountingReward:
    """total = mean brightness of the video; counts the videos it scored."""

    components = ("bright",)

    def __init__(self):
        self.scored = 0

    def __call__(self, videos, prompts):
        self.scored += videos.shape[0]
        bright = videos.mean(dim=(1, 2, 3, 4))
        return {"total": bright, "bright": bright}


class IdentityVAE:
    config = SimpleNamespace(scaling_factor=1.0)


b = 3  # not divisible by sp: one sp rank scores 2 videos, the other 1
latents = torch.arange(b, dtype=torch.float32)[:, None, None, None, None].expand(b, 3, 2, 4, 4) / 10 + info.dp_rank
traj = SimpleNamespace(batch_size=b, final_latents=latents.clone(), prompts=[f"p{i}" for i in range(b)])
reward = CountingReward()
run = SimpleNamespace(info=info, reward=reward, pipe=SimpleNamespace(vae=IdentityVAE()))
import sage_grpo.rollout as rollout_mod  # noqa: E402

rollout_mod.decode_latents = lambda vae, x: x.permute(0, 2, 1, 3, 4).clamp(0, 1)  # [b, F, C, H, W], no VAE
names, scores = pt.score_videos(run, traj)
out["names"] = names
out["scores"] = scores.tolist()
out["scored"] = reward.scored
Path(sys.argv[1], f"rank{info.rank}.json").write_text(json.dumps(out))
dist.barrier()  # no rank closes its gloo connections while a peer still uses them
dist.destroy_process_group()
