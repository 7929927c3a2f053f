"""Muon on FSDP2 row shards: each matrix is orthogonalised whole on one owner rank (gather -> Newton-Schulz -> scatter).

`torch.optim.Muon` run directly on FSDP2's DTensor parameters is correct but slow: DTensor inserts ~16 collectives
per matrix per step and every rank repeats every Newton-Schulz iteration (stack notes, "Muon on FSDP2 shards").
`ShardedMuon` is the distributed-Muon scheme of torchtitan's `DistributedMuon`, microsoft/dion's `muon.py`,
samsja/muon_fsdp_2 and Moonshot's "Muon is Scalable" (arXiv 2502.16982), written as a subclass of torch's Muon:
1. momentum (lerp, Nesterov) is element-wise: computed on the local row shards, no communication;
2. the matrices with a gradient are taken in param-group order (identical on every rank) and matrix i gets the owner
   rank i % W over the shard axis (W ranks) of its mesh (round-robin);
3. every rank sends its rows of the Nesterov update, padded to ceil(rows / W) rows (FSDP2's `torch.chunk` layout
   leaves the last shards shorter or empty), to the owner with one `gather` (cast to bf16 first: torch's
   `_zeropower_via_newtonschulz` starts with `.bfloat16()`, so casting before the transfer is the same value and half
   the bytes);
4. the owner runs torch's `_zeropower_via_newtonschulz` on the whole matrix; all gathers are issued before any
   Newton-Schulz and all scatters after, so the W owners orthogonalise their matrices at the same time;
5. one `scatter` returns each rank its rows of the orthogonalised update;
6. each rank applies the decoupled weight decay and the update to its local shard with torch's `_adjust_lr` of the
   GLOBAL shape (the local shape would give a wrong 0.2 * sqrt(max(A, B))).
Gathers and scatters move values without arithmetic and the owner computes on the same whole matrix as one
process would, so given the same gradients the result equals `torch.optim.Muon` bitwise (tested on 2 gloo ranks).
HSDP (placements (Replicate, Shard(0))): matrices are owned over the Shard(0) mesh axis; the replicas hold equal
gradients after FSDP2's all-reduce and compute the same thing. Parameters that are not DTensors (one process, or a
part left unsharded) take torch's own `muon` function unchanged. The state dict is torch's (`momentum_buffer` per
parameter, a DTensor under FSDP2), so DCP checkpoints are interchangeable with plain Muon runs.

Why a subclass with its own `step` rather than torch's step: torch's `_single_tensor_muon` calls Newton-Schulz on
whatever tensor it is given, with no hook between the momentum and the orthogonalisation where the gather could go;
we reuse its pieces (`_init_group`, `_zeropower_via_newtonschulz`, `_adjust_lr`, `muon`) and write only the
communication and the three element-wise lines around it. `_zeropower_via_newtonschulz` / `_adjust_lr` are private
torch names (stable since Muon landed in 2.9); a rename fails loudly at import.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz, muon

__all__ = ["ShardedMuon", "shard_axis"]


def shard_axis(p) -> int:
    """Mesh dimension over which the DTensor `p` is row-sharded (Shard(0)); every other dimension must replicate."""
    from torch.distributed.tensor import Replicate, Shard

    axes = [d for d, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    if len(axes) != 1 or p.placements[axes[0]].dim != 0 or not all(
        isinstance(pl, Replicate) for d, pl in enumerate(p.placements) if d != axes[0]
    ):
        raise ValueError(f"ShardedMuon needs parameters sharded by rows on one mesh axis, got {p.placements}")
    return axes[0]


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon whose DTensor (FSDP2) matrices are orthogonalised whole on one owner rank each.

    Same constructor, hyper-parameters and state dict as torch.optim.Muon. `step` is collective over every mesh of
    the DTensor parameters: all ranks must call it (with gradients present for the same parameters).
    """

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            has_complex = self._init_group(group, params, grads, bufs)
            hyper = dict(lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["momentum"],
                         nesterov=group["nesterov"], ns_coefficients=group["ns_coefficients"], eps=group["eps"],
                         ns_steps=group["ns_steps"], adjust_lr_fn=group["adjust_lr_fn"])
            plain = [i for i, p in enumerate(params) if not isinstance(p, DTensor)]
            if plain:  # torch's own code, untouched
                muon([params[i] for i in plain], [grads[i] for i in plain], [bufs[i] for i in plain],
                     has_complex=has_complex, **hyper)
            sharded = [i for i, p in enumerate(params) if isinstance(p, DTensor)]
            if sharded:
                _sharded_muon([params[i] for i in sharded], [grads[i] for i in sharded], [bufs[i] for i in sharded],
                              **hyper)
        return loss


def _sharded_muon(params, grads, bufs, *, lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
                  adjust_lr_fn) -> None:
    lr = float(lr)
    jobs = []  # per matrix: (param, group, my index on the axis, W, owner, padded rows, local update)
    for i, (p, g, b) in enumerate(zip(params, grads, bufs)):
        if p.ndim != 2:
            raise ValueError("Param gradient must be a 2D matrix")
        axis = shard_axis(p)
        mesh = p.device_mesh
        pg, me, w = mesh.get_group(axis), mesh.get_local_rank(axis), mesh.size(axis)
        g_loc, b_loc = g.to_local(), b.to_local()  # [rows_local, cols] (rows_local may be 0)
        b_loc.lerp_(g_loc, 1 - momentum)  # the same two element-wise lines as torch's _single_tensor_muon
        u_loc = g_loc.lerp(b_loc, momentum) if nesterov else b_loc
        rows, cols = p.shape
        chunk = math.ceil(rows / w)
        send = u_loc.new_zeros((chunk, cols), dtype=torch.bfloat16)
        send[: u_loc.shape[0]] = u_loc  # the bf16 cast torch's Newton-Schulz would do first
        jobs.append(dict(p=p, pg=pg, me=me, w=w, owner=i % w, chunk=chunk, send=send))
    # 1. every matrix's rows to its owner (all issued at once; gloo and NCCL keep the per-group order)
    works = []
    for j in jobs:
        j["parts"] = [torch.empty_like(j["send"]) for _ in range(j["w"])] if j["me"] == j["owner"] else None
        works.append(dist.gather(j["send"], gather_list=j["parts"], group=j["pg"], group_dst=j["owner"], async_op=True))
    for wk in works:
        wk.wait()
    # 2. the owners orthogonalise their whole matrices (no communication)
    for j in jobs:
        if j["parts"] is not None:
            rows = j["p"].shape[0]
            full = torch.cat(j["parts"])[:rows]  # [rows, cols] bf16
            ortho = _zeropower_via_newtonschulz(full, ns_coefficients, ns_steps, eps)
            padded = ortho.new_zeros((j["chunk"] * j["w"], ortho.shape[1]))
            padded[:rows] = ortho
            j["pieces"] = list(padded.split(j["chunk"]))
        else:
            j["pieces"] = None
    # 3. each rank gets its rows of the update back
    works = []
    for j in jobs:
        j["recv"] = torch.empty_like(j["send"])
        works.append(dist.scatter(j["recv"], scatter_list=j["pieces"], group=j["pg"], group_src=j["owner"],
                                  async_op=True))
    for wk in works:
        wk.wait()
    # 4. decoupled weight decay and the update on the local rows, lr scaled by the GLOBAL shape (as torch does)
    for j in jobs:
        p_loc = j["p"].to_local()
        p_loc.mul_(1 - lr * weight_decay)
        p_loc.add_(j["recv"][: p_loc.shape[0]], alpha=-_adjust_lr(lr, adjust_lr_fn, j["p"].shape))
