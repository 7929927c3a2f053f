"""Process layout of a run and the few collectives the training loop needs.

`python post_train.py` without torchrun is world size 1: no process group is created and every collective below
is a no-op. Under torchrun the group is NCCL on GPUs and gloo on CPU. Ranks are laid out dp x sp with contiguous
sequence-parallel groups (rank = dp_rank * sp_size + sp_rank), so a data-parallel rank's sp peers are neighbours
(on one node: the sp all-to-all stays on NVLink).

The device mesh has three named dimensions, (dp_replicate, dp_shard, sp), of sizes
(R, dp / R, sp) with dp = world / sp: FSDP2 shards parameters over the flattened (dp_shard, sp) ranks and
replicates them R times (HSDP when R > 1); the Ulysses all-to-all runs inside `sp`; group-relative rewards are
gathered over `dp` (every rank with the same sp_rank). Without FSDP2, `sync_gradients` turns the ranks' partial
gradients into the step's gradient (sum over sp, mean over dp). The divisibility rules are `config.validate`'s,
checked before any process group exists.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "init_distributed", "build_mesh", "all_reduce_sum", "all_gather_cat", "barrier",
           "mean_metrics", "sync_gradients", "destroy"]


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    sp_size: int = 1
    device: torch.device = torch.device("cpu")
    dp_replicate: int = 1
    mesh: object = field(default=None, compare=False, repr=False)  # DeviceMesh (dp_replicate, dp_shard, sp) or None
    dp_mesh: object = field(default=None, compare=False, repr=False)  # 1-D over the dp ranks with my sp_rank
    fsdp_mesh: object = field(default=None, compare=False, repr=False)  # what FSDP2 shards over (see build_mesh)

    @property
    def sp_group(self):
        """Process group of my sequence-parallel peers (None when sp = 1)."""
        return self.mesh.get_group("sp") if self.mesh is not None and self.sp_size > 1 else None

    @property
    def dp_group(self):
        """Process group of the ranks with my sp_rank across all data-parallel ranks (None at world size 1; a
        group of one rank when dp = 1, so that reductions over it never fall back to the whole world)."""
        return self.dp_mesh.get_group() if self.dp_mesh is not None else None

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def build_mesh(device_type: str, world: int, sp_size: int, dp_replicate: int):
    """-> (mesh, dp_mesh, fsdp_mesh). mesh: (dp_replicate, dp_shard, sp); dp_mesh: its (dp_replicate, dp_shard)
    dims flattened; fsdp_mesh: (dp_shard, sp) flattened, or for HSDP the 2-D (dp_replicate, dp_shard_sp) mesh
    (the same rank order). Needs the default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    dp = world // sp_size
    mesh = init_device_mesh(device_type, (dp_replicate, dp // dp_replicate, sp_size),
                            mesh_dim_names=("dp_replicate", "dp_shard", "sp"))
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    if dp_replicate == 1:
        return mesh, dp_mesh, mesh["dp_shard", "sp"]._flatten("dp_shard_sp")
    # a 2-D slice mixing a flattened dim is deprecated in torch >= 2.11: build the HSDP mesh on its own (rank
    # = replica * (dp_shard * sp) + shard rank, as in `mesh`)
    hsdp = init_device_mesh(device_type, (dp_replicate, world // dp_replicate),
                            mesh_dim_names=("dp_replicate", "dp_shard_sp"))
    return mesh, dp_mesh, hsdp


def init_distributed(sp_size: int = 1, dp_replicate: int = 1, timeout_minutes: float | None = None) -> DistInfo:
    """Read torchrun's environment, pick the device (cuda:LOCAL_RANK when CUDA is present) and, for world size > 1,
    create the default process group (NCCL on GPU, gloo on CPU) and the device mesh. The geometry must already
    have passed `config.validate(cfg, world_size)`. timeout_minutes: how long a collective waits for the slowest rank
    (torch's default, 10 min for NCCL, when None)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)  # before NCCL init, so its barrier does not land on GPU 0 for every rank
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes) if timeout_minutes else None
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None, timeout=timeout)
    mesh, dp_mesh, fsdp_mesh = build_mesh(device.type, world, sp_size, dp_replicate) if world > 1 else (None,) * 3
    return DistInfo(rank=rank, world_size=world, local_rank=local, sp_size=sp_size, device=device,
                    dp_replicate=dp_replicate, mesh=mesh, dp_mesh=dp_mesh, fsdp_mesh=fsdp_mesh)


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over the ranks of `group` (default: all ranks), in place and returned; identity at world size 1. A CPU
    tensor under NCCL (which reduces CUDA tensors only) makes a round trip through the current GPU."""
    if _active():
        if t.device.type == "cpu" and dist.get_backend(group) == "nccl":
            on_gpu = t.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(on_gpu, op=dist.ReduceOp.SUM, group=group)
            t.copy_(on_gpu)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_gather_cat(t: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate equally shaped tensors of the ranks of `group` (default: all) along dim 0, in rank order."""
    if not _active():
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def sync_gradients(params: list, info: DistInfo, fsdp: bool) -> None:
    """Sum the gradients over all ranks and divide by dp: the mean over data-parallel ranks of the sp groups' sums
    (every rank calls it with the same parameters; a missing gradient counts as zeros). FSDP2 (fsdp=True) already
    reduce-scattered them during backward."""
    if not info.distributed or fsdp:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        all_reduce_sum(p.grad).div_(info.dp_size)


def mean_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Each key's mean over the ranks that report it (ranks may report different keys, e.g. a phase that only
    some ranks ran). Collective: every rank calls it once per logged step."""
    if not _active():
        return dict(metrics)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, {k: float(v) for k, v in metrics.items()})
    out: dict[str, float] = {}
    for key in sorted({k for m in every for k in m}):
        vals = [m[key] for m in every if key in m]
        out[key] = sum(vals) / len(vals)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s picklable `obj` on every rank (collective; identity at world size 1). Only for small values the
    ranks produce themselves (a path, a message), never for anything read from a user's file."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if _active():
        dist.barrier()


def destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
