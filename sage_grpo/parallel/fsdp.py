"""FSDP2 for the HunyuanVideo-1.5 policy: sharding, meta-device loading, the sharded anchor, state-dict helpers.

Layout (torchtitan's): `fully_shard` on every transformer block (the 54 double-stream blocks and the text
refiner's blocks), then on the root (embedders, norm_out, proj_out), over `DistInfo.fsdp_mesh` (1-D over the
flattened dp_shard x sp ranks; 2-D (dp_replicate, dp_shard_sp) = HSDP). Only the transformer is sharded: the VAE,
the text encoders and the reward model stay replicated (frozen, no optimizer state, and small next to the 8.3B
transformer's fp32 master weights + gradients + optimizer state).

Gradients: with sequence parallelism the sp ranks of one dp rank see the same samples and each produces a PARTIAL
parameter gradient (its tokens' share); the loss is a per-dp-rank mean. The wanted gradient is the sum over sp and
the mean over dp: FSDP2 sums over its whole mesh (dp * sp ranks), so the divide factor is set to dp
(`set_gradient_divide_factor`). gloo has no PREMUL_SUM reduction, so on CPU FSDP2 is told to reduce with SUM and
divide afterwards (`set_force_sum_reduction_for_comms`); on NCCL the division is fused into the reduce-scatter.

Mixed precision: `MixedPrecisionPolicy(param_dtype=--dtype, reduce_dtype=float32)` over master weights in
`--master_weight_type` (the sharded parameters keep the master dtype; the all-gather casts to --dtype).

Loading (`load_sharded_transformer`): the model is built from its config on the meta device (LoRA injected there,
its initial values computed exactly as the unsharded path computes them), sharded, `to_empty`, and every rank reads
only its rows of each tensor from the diffusers safetensors (`safe_open(...).get_slice`): host memory per rank is
its shards plus one tensor's rows, never the whole model.

Anchor (`ShardedAnchor`): a frozen copy built the same way and sharded identically; `refresh` copies local shard
to local shard (no collective, no rank ever holds a full tensor). Optional CPU offload keeps its shards on the host
(FSDP2 `CPUOffloadPolicy`: shards are copied to the device for the all-gather of each block's forward).

post_train.py uses these in `load_policy` (world size > 1 with --enable_fsdp; one process keeps the plain path),
`Anchor` (ShardedAnchor for full fine-tuning; LoRA adapter sets copied shard by shard) and the checkpoint functions
(DCP of torch's sharded state dicts; the small LoRA files gathered with `sharded_lora_state` on every rank).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

__all__ = [
    "BLOCK_LISTS",
    "mixed_precision_policy",
    "transformer_blocks",
    "shard_transformer",
    "build_meta_transformer",
    "load_sharded_transformer",
    "materialize_sharded",
    "ShardedAnchor",
    "copy_local_shards_",
    "local_rows",
    "gather_full",
    "copy_full_into_shards_",
    "sharded_lora_state",
    "load_lora_sharded",
    "clone_local_shards",
]

# ModuleLists whose entries are the FSDP2 units (attribute paths inside HunyuanVideo15Transformer3DModel).
BLOCK_LISTS = ("transformer_blocks", "context_embedder.token_refiner.refiner_blocks")


def mixed_precision_policy(param_dtype: torch.dtype, master_dtype: torch.dtype):
    """Compute in `param_dtype` (--dtype), reduce gradients in fp32, keep master weights in `master_dtype`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=None if param_dtype == master_dtype else param_dtype,
                                reduce_dtype=torch.float32)


def transformer_blocks(transformer: nn.Module) -> list[nn.Module]:
    """The FSDP2 units below the root, in forward order."""
    blocks = []
    for path in BLOCK_LISTS:
        mod = transformer
        for part in path.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        if mod is not None:
            blocks.extend(mod)
    return blocks


def shard_transformer(transformer: nn.Module, info, *, param_dtype: torch.dtype | None = None,
                      master_dtype: torch.dtype | None = None, gradient_checkpointing: bool = False,
                      offload: bool = False) -> nn.Module:
    """fully_shard per block, then the root, over `info.fsdp_mesh` -> the same module (now an FSDPModule).

    Works on a materialised module (its parameters become DTensor shards) or on a meta-device one (then call
    `materialize_sharded`). Gradient divide factor = dp (see the module docstring). Needs a process group.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

    if info.fsdp_mesh is None:
        raise ValueError("shard_transformer needs world size > 1 (a device mesh); one process trains unsharded")
    master_dtype = master_dtype or next(transformer.parameters()).dtype
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing()  # diffusers checkpoints each block; FSDP2 re-gathers inside
    kw = dict(mesh=info.fsdp_mesh,
              mp_policy=mixed_precision_policy(param_dtype or master_dtype, master_dtype),
              offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy())
    for block in transformer_blocks(transformer):
        fully_shard(block, **kw)
    fully_shard(transformer, **kw)
    # FSDP2's default divides by the whole mesh (dp * sp): right when sp = 1. With sp > 1 divide by dp only.
    if info.sp_size > 1:
        shard_size = info.fsdp_mesh.size(info.fsdp_mesh.ndim - 1)
        # gloo has no PREMUL_SUM, the op FSDP2 picks for a factor != the reduce-scatter group's size; forcing SUM +
        # a post-division instead is only done when a reduce-scatter runs (torch 2.13 divides twice when the shard
        # group has size 1 and sum reduction is forced).
        force_sum = info.device.type == "cpu" and shard_size > 1 and shard_size != info.dp_size
        for m in transformer.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(float(info.dp_size))
                if force_sum:
                    m.set_force_sum_reduction_for_comms(True)
    return transformer


# ------------------------------------------------------------------------------------------------ meta-device build


def _zero_storage_like(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of t's shape and dtype that owns one element (stride-0 view): shape-only stand-in."""
    return torch.zeros((), dtype=t.dtype).expand(t.shape)


def build_meta_transformer(config: dict, *, dtype: torch.dtype = torch.float32, lora: dict | None = None):
    """HunyuanVideo15Transformer3DModel from `config` on the meta device (no memory) in `dtype` (the master
    weights, as the unsharded path loads them before injecting LoRA) -> (model, lora_init).

    lora: setup_trainable's keyword arguments (use_lora=True, lora_r, ...) or None for full fine-tuning. The LoRA
    adapters are injected with the base weights present as zero-memory CPU stand-ins (stride-0 views), so peft
    creates and initialises them on the CPU exactly as in the unsharded path: the same draws from the global
    generator in the same order (the caller seeds it as post_train does), and a --pretrained_lora_path is loaded.
    `lora_init` = {name: full initial adapter tensor} (small), which `materialize_sharded` slices per rank; then the
    whole model (adapters included) is moved to meta so that fully_shard sees one device.
    """
    from diffusers import HunyuanVideo15Transformer3DModel

    from sage_grpo.models.attention import use_valid_token_attention

    with torch.device("meta"):
        model = HunyuanVideo15Transformer3DModel.from_config(config).to(dtype)
    use_valid_token_attention(model)
    lora_init: dict[str, torch.Tensor] = {}
    if lora is not None and lora.get("use_lora"):
        from sage_grpo.models.lora import setup_trainable

        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    mod._parameters[name] = nn.Parameter(_zero_storage_like(p), requires_grad=p.requires_grad)
        setup_trainable(model, **lora)
        lora_init = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    mod._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"),
                                                         requires_grad=p.requires_grad)
    elif lora is not None:
        from sage_grpo.models.lora import setup_trainable

        setup_trainable(model, **lora)  # full fine-tuning: every parameter trainable
    if any(True for _ in model.buffers()):
        # HunyuanVideo-1.5 (diffusers 0.42) has no buffers (its rotary tables are computed in forward); a future
        # version with buffers would need them re-initialised after to_empty: refuse instead of training on garbage.
        raise NotImplementedError("the transformer has buffers; meta-device loading must re-initialise them")
    return model, lora_init


def local_rows(p) -> tuple[int, int]:
    """(first global row, number of rows) of this rank's shard of the Shard(0) DTensor `p` (FSDP2's torch.chunk
    layout: the last shards may be shorter or empty)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return (offset[0], shape[0]) if len(shape) else (0, 0)


def materialize_sharded(model: nn.Module, device, reader, lora_init: dict | None = None) -> None:
    """to_empty the sharded meta model on `device`, then fill every parameter's local rows.

    reader(name, start, stop) -> rows [start, stop) of the checkpoint tensor for parameter `name` (peft's
    `.base_layer.` removed); LoRA parameters come from `lora_init` (full tensors, sliced here).
    """
    from torch.distributed.tensor import DTensor

    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            start, n = local_rows(p) if isinstance(p, DTensor) else (0, p.shape[0] if p.ndim else 1)
            if "lora_" in name:
                src = lora_init[name]
                src = src[start : start + n] if src.ndim else src
            else:
                src = reader(name.replace(".base_layer.", "."), start, start + n)
            if p.ndim == 0:
                src = src.reshape(())
            local.copy_(src.to(device=local.device, dtype=local.dtype))


def load_sharded_transformer(model_dir: str | Path, info, *, master_dtype: torch.dtype, param_dtype: torch.dtype,
                             lora: dict | None = None, gradient_checkpointing: bool = False):
    """The policy transformer, FSDP2-sharded, each rank reading only its rows -> (transformer, trainable params).

    model_dir: a diffusers `transformer/` directory (config.json + diffusion_pytorch_model*.safetensors).
    lora: setup_trainable's keyword arguments ({"use_lora": ..., "lora_r": ..., ...}); call torch.manual_seed(seed)
    before, as for the unsharded path, and the adapters start identical. Returns the trainable parameters (DTensors)
    like setup_trainable.
    """
    from sage_grpo.models.loading import read_transformer_config, transformer_row_reader

    model_dir = Path(model_dir)
    model, lora_init = build_meta_transformer(read_transformer_config(model_dir), dtype=master_dtype, lora=lora)
    shard_transformer(model, info, param_dtype=param_dtype, master_dtype=master_dtype,
                      gradient_checkpointing=gradient_checkpointing)
    with transformer_row_reader(model_dir) as reader:
        materialize_sharded(model, info.device, reader, lora_init)
    model.eval()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, trainable


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
    """A frozen FSDP2 copy of the full-fine-tuning policy, sharded like it (optionally kept on the CPU).

    build: built on meta from the policy's config (no weights read), sharded with the policy's settings, then
    filled from the policy's local shards. `refresh()` copies the policy's local shards again. `module` is the
    anchor's forward (an FSDP2 module: every rank must run its forwards together, as for the policy).
    """

    def __init__(self, policy: nn.Module, info, *, param_dtype: torch.dtype | None = None, offload: bool = False):
        master = next(policy.parameters()).dtype
        self.module, _ = build_meta_transformer(dict(policy.config), dtype=master)
        shard_transformer(self.module, info, param_dtype=param_dtype or master, master_dtype=master,
                          offload=offload)
        self.module.to_empty(device=torch.device("cpu") if offload else info.device)
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


def sharded_lora_state(transformer) -> dict[str, torch.Tensor]:
    """The adapter in peft's key layout (what sage_grpo.models.lora.save_lora writes), gathered whole on every
    rank (collective; the adapter is small)."""
    from sage_grpo.models.lora import lora_state_dict

    return gather_full(lora_state_dict(transformer))


def load_lora_sharded(transformer, path) -> None:
    """`load_lora` for an FSDP2 model: every rank reads the adapter file and copies its own rows (no collective)."""
    from sage_grpo.errors import SageGRPOError
    from sage_grpo.models.lora import ADAPTER_NAME, adapter_parameters, read_adapter

    path, state = read_adapter(path)
    params = {n.replace(f".{ADAPTER_NAME}.", "."): p for n, p in adapter_parameters(transformer).items()}
    if sorted(params) != sorted(state):
        raise SageGRPOError(f"LoRA adapter {path} does not fit the model (check --lora_r / --lora_target_modules)")
    copy_full_into_shards_(params, state)
