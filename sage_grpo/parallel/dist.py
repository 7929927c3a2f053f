"""Process layout of a run and the few collectives the training loop needs.

`python post_train.py` without torchrun is world size 1: no process group is created and every collective below
is a no-op. Under torchrun the group is NCCL on GPUs and gloo on CPU. Ranks are laid out dp x sp with contiguous
sequence-parallel groups (rank = dp_rank * sp_size + sp_rank), so a data-parallel rank's sp peers are neighbours.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "init_distributed", "all_reduce_sum", "all_gather_cat", "barrier", "broadcast_object",
           "destroy"]


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    sp_size: int = 1
    device: torch.device = torch.device("cpu")

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


def init_distributed(sp_size: int = 1) -> DistInfo:
    """Read torchrun's environment, pick the device (cuda:LOCAL_RANK when CUDA is present) and, for world size > 1,
    create the default process group (NCCL on GPU, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)  # before NCCL init, so its barrier does not land on GPU 0 for every rank
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    return DistInfo(rank=rank, world_size=world, local_rank=local, sp_size=sp_size, device=device)


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks (in place, also returned); identity at world size 1."""
    if _active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate equally shaped tensors of all ranks along dim 0, in rank order."""
    if not _active():
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def barrier() -> None:
    if _active():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s Python object on every rank."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
