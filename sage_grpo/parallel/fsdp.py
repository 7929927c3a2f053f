"""FSDP2, model-agnostic: sharding given block lists, filling a sharded meta-device model row by row, the sharded
frozen copy (anchor), and shard-local copies / small gathers of (possibly DTensor) tensors.

Layout (torchtitan's): `fully_shard` on every block the caller lists, then on the root, over `DistInfo.fsdp_mesh`
(1-D over the flattened dp_shard x sp ranks; 2-D (dp_replicate, dp_shard_sp) = HSDP). Which modules are the blocks,
how the model is built on the meta device and where its weights are read from is the model's business
(`sage_grpo.models.parallelize` for HunyuanVideo-1.5).

Gradients: with sequence parallelism the sp ranks of one dp rank see the same samples and each produces a PARTIAL
parameter gradient (its tokens' share); the loss is a per-dp-rank mean. The wanted gradient is the sum over sp and
the mean over dp: FSDP2 sums over its whole mesh (dp * sp ranks), so the divide factor is set to dp
(`set_gradient_divide_factor`). gloo has no PREMUL_SUM reduction, so on CPU FSDP2 is told to reduce with SUM and
divide afterwards (`set_force_sum_reduction_for_comms`); on NCCL the division is fused into the reduce-scatter.

Mixed precision: `MixedPrecisionPolicy(param_dtype=--dtype, reduce_dtype=float32, cast_forward_inputs=False)` over
master weights in `--master_weight_type` (the sharded parameters keep the master dtype; the all-gather casts to
--dtype). FSDP2 leaves the forward inputs alone: the caller casts them, exactly as in one process
(`sage_grpo.rollout.predict_velocity`: latents and text in --dtype, timestep fp32 under autocast). With FSDP2's
default (cast_forward_inputs=True) every FSDP unit's floating inputs were cast to --dtype: the root's timestep
(1000 sigma rounded to bf16 moves t by up to 2) and every block's rotary cos/sin, so sharded runs computed a
different velocity from one process (3.5e-2 against 4.9e-3 on the tiny model, tests/test_parallel_fsdp.py).

Rollout (`keep_unsharded`): FSDP2 re-gathers every block for every forward (reshard_after_forward=True, the
memory-lean default the update needs). The rollout is T x (batch / chunk) forward-only calls of the same weights,
so inside `keep_unsharded` the units keep their gathered parameters from their first forward to the end of the
rollout: one all-gather per unit per rollout instead of one per forward, for the memory of the whole model in
--dtype on every rank (scripts/plan_memory.py prints both). No collective is added or removed unevenly: every rank
runs the same forwards, so every rank skips the same all-gathers.

Loading (`materialize_sharded`): a model sharded on the meta device is `to_empty`'d and every rank fills only its
rows of each parameter from a row reader: host memory per rank is its shards plus one tensor's rows, never the
whole model.

Anchor (`ShardedAnchor`): a frozen copy sharded identically to its source; `refresh` copies local shard to local
shard (no collective, no rank ever holds a full tensor). Optional CPU offload keeps its shards on the host (FSDP2
`CPUOffloadPolicy`: shards are copied to the device for the all-gather of each block's forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

__all__ = [
    "mixed_precision_policy",
    "shard_modules",
    "keep_unsharded",
    "local_rows",
    "materialize_sharded",
    "ShardedAnchor",
    "copy_local_shards_",
    "clone_local_shards",
    "gather_full",
    "copy_full_into_shards_",
]


def mixed_precision_policy(param_dtype: torch.dtype, master_dtype: torch.dtype):
    """Compute in `param_dtype` (--dtype), reduce gradients in fp32, keep master weights in `master_dtype`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # cast_forward_inputs=False: the inputs keep the dtypes the caller gave them, as in one process (module
    # docstring); predict_velocity casts latents and text itself and runs the forward under autocast, so the fp32
    # timestep and rotary tables meet bf16 weights only inside autocast's matmuls, never as a bf16-rounded input.
    return MixedPrecisionPolicy(param_dtype=None if param_dtype == master_dtype else param_dtype,
                                reduce_dtype=torch.float32, cast_forward_inputs=False)


def shard_modules(root: nn.Module, blocks: Iterable[nn.Module], info, *, param_dtype: torch.dtype | None = None,
                  master_dtype: torch.dtype | None = None, offload: bool = False) -> nn.Module:
    """fully_shard each of `blocks` (the FSDP2 units below the root, in forward order), then `root`, over
    `info.fsdp_mesh` -> `root` (now an FSDPModule).

    Works on a materialised module (its parameters become DTensor shards) or on a meta-device one (then call
    `materialize_sharded`). Gradient divide factor = dp (see the module docstring). Needs a process group.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

    if info.fsdp_mesh is None:
        raise ValueError("shard_modules needs world size > 1 (a device mesh); one process trains unsharded")
    master_dtype = master_dtype or next(root.parameters()).dtype
    kw = dict(mesh=info.fsdp_mesh,
              mp_policy=mixed_precision_policy(param_dtype or master_dtype, master_dtype),
              offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy())
    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(root, **kw)
    # FSDP2's default divides by the whole mesh (dp * sp): right when sp = 1. With sp > 1 divide by dp only.
    if info.sp_size > 1:
        shard_size = info.fsdp_mesh.size(info.fsdp_mesh.ndim - 1)
        # gloo has no PREMUL_SUM, the op FSDP2 picks for a factor != the reduce-scatter group's size; forcing SUM +
        # a post-division instead is only done when a reduce-scatter runs (torch 2.13 divides twice when the shard
        # group has size 1 and sum reduction is forced).
        force_sum = info.device.type == "cpu" and shard_size > 1 and shard_size != info.dp_size
        for m in root.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(float(info.dp_size))
                if force_sum:
                    m.set_force_sum_reduction_for_comms(True)
    return root


@contextlib.contextmanager
def keep_unsharded(root: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, `root`'s FSDP2 units do not reshard after forward: each is all-gathered by its first
    forward and stays gathered for the following ones (the rollout's T steps); on exit every unit is resharded (the
    memory is freed before the update) and gets FSDP2's defaults back, the ones `shard_modules` uses: reshard after
    forward, except the root, which FSDP2 keeps gathered from forward to backward. No collective (every rank must
    still run the same forwards inside). A no-op when not enabled or `root` is not sharded (one process).

    Meant for no-grad forwards: with autograd, a backward inside would find the parameters gathered (correct) and
    reshard them after backward as usual.
    """
    from torch.distributed.fsdp import FSDPModule

    if not enabled or not isinstance(root, FSDPModule):
        yield
        return
    root.set_reshard_after_forward(False)  # every unit below root too
    try:
        yield
    finally:
        root.set_reshard_after_forward(True)
        root.set_reshard_after_forward(False, recurse=False)  # fully_shard(reshard_after_forward=None)'s root value
        for m in root.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


# ------------------------------------------------------------------------------------------------ meta-device load


def local_rows(p) -> tuple[int, int]:
    """(first global row, number of rows) of this rank's shard of the Shard(0) DTensor `p` (FSDP2's torch.chunk
    layout: the last shards may be shorter or empty)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return (offset[0], shape[0]) if len(shape) else (0, 0)


def materialize_sharded(model: nn.Module, device, reader: Callable[[str, int, int], torch.Tensor],
                        init: dict[str, torch.Tensor] | None = None) -> None:
    """to_empty the sharded meta model on `device`, then fill every parameter's local rows.

    reader(name, start, stop) -> rows [start, stop) of the stored tensor of parameter `name`; the parameters in
    `init` ({name: full tensor}, e.g. freshly initialised adapters that no checkpoint holds) are sliced from there.
    """
    from torch.distributed.tensor import DTensor

    init = init or {}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            start, n = local_rows(p) if isinstance(p, DTensor) else (0, p.shape[0] if p.ndim else 1)
            if name in init:
                src = init[name]
                src = src[start : start + n] if src.ndim else src
            else:
                src = reader(name, start, start + n)
            if p.ndim == 0:
                src = src.reshape(())
            local.copy_(src.to(device=local.device, dtype=local.dtype))


# ------------------------------------------------------------------------------------------------ anchor


@torch.no_grad()
def copy_local_shards_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i] <- src[i] shard by shard (`to_local()` on both sides: never a collective, never a full tensor)."""
    from torch.distributed.tensor import DTensor

    if len(dst) != len(src):
        raise ValueError(f"{len(dst)} destination tensors for {len(src)} sources")
    for d, s in zip(dst, src):
        if isinstance(d, DTensor) != isinstance(s, DTensor) or (
            isinstance(d, DTensor) and (d.placements != s.placements or d.shape != s.shape)
        ):
            raise ValueError("anchor and policy must be sharded identically")
        dl = d.to_local() if isinstance(d, DTensor) else d
        sl = s.to_local() if isinstance(s, DTensor) else s
        dl.copy_(sl)  # across devices when the anchor is offloaded


class ShardedAnchor:
    """A frozen FSDP2 copy of `policy`: `module` is a meta-device twin of the policy sharded like it (same
    parameter names, shapes and placements; built by the model's recipe, e.g.
    `sage_grpo.models.parallelize.build_sharded_anchor`), materialised on `device` (the CPU when offloaded) and
    filled from the policy's local shards. `refresh()` copies them again. `module` is the anchor's forward (an FSDP2
    module: every rank must run its forwards together, as for the policy).
    """

    def __init__(self, module: nn.Module, policy: nn.Module, device):
        self.module = module
        self.module.to_empty(device=device)
        self.module.requires_grad_(False).eval()
        mine, theirs = dict(self.module.named_parameters()), dict(policy.named_parameters())
        if sorted(mine) != sorted(theirs):
            raise ValueError("the anchor's parameters differ from the policy's (LoRA policies use adapter anchors)")
        self._dst, self._src = list(mine.values()), [theirs[n] for n in mine]  # matched by name, once
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        copy_local_shards_(self._dst, self._src)


def clone_local_shards(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{name: detached copy} of (possibly DTensor) parameters, each rank copying only its shard (a DTensor's
    clone is local): the LoRA moving anchor's second adapter set."""
    return {k: p.detach().clone() for k, p in params.items()}


# ------------------------------------------------------------------------------------------------ state dicts


def gather_full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{name: whole tensor} of (possibly DTensor) tensors: collective, every rank must call it. For SMALL sets only
    (LoRA adapters, the anchor's adapter set) that rank 0 then writes with safetensors."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in tensors.items()}


@torch.no_grad()
def copy_full_into_shards_(params: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    """params[k] <- full[k], each rank copying only its own rows into its shard (no collective)."""
    from torch.distributed.tensor import DTensor

    for k, p in params.items():
        src = full[k]
        if isinstance(p, DTensor):
            start, n = local_rows(p)
            p.to_local().copy_(src[start : start + n].to(p.dtype))
        else:
            p.copy_(src)
