"""How HunyuanVideo-1.5's transformer is parallelised (torchtitan's per-model parallelize.py): one ordered
`parallelize`, plus the meta-device builds that FSDP2 loading and the sharded anchor start from.

`parallelize(transformer, info, ...)` applies, in this order:
1. Ulysses sequence parallelism inside `info.sp_group` (`sage_grpo.models.sequence_parallel`: the attention
   processor and the split/gather hooks; a no-op at sp = 1);
2. activation checkpointing (diffusers' per-block checkpointing; under FSDP2 a recomputed block re-gathers its
   parameters);
3. regional compilation when asked (`--compile`, sage_grpo.models.compile: each dual-stream block's forward; before
   fully_shard, as torchtitan orders it; its hooks, FSDP2's included, stay eager);
4. FSDP2 when asked: `fully_shard` on every block of `BLOCK_LISTS` (the 54 double-stream blocks and the text
   refiner's blocks), then on the root (embedders, norm_out, proj_out), over `info.fsdp_mesh`
   (`sage_grpo.parallel.fsdp.shard_modules`). Only the transformer is sharded: the VAE, the text encoders and the
   reward model stay replicated (frozen, no optimizer state, and small next to the 8.3B transformer's fp32 master
   weights + gradients + optimizer state).
Steps 1 to 3 touch attention processors, three modules' forward hooks, a flag and a forward per block, not parameters;
sharding comes last because fully_shard groups the parameters that exist when it runs, so LoRA is injected before
`parallelize` (peft wraps the Linear layers that FSDP2 then shards). `use_valid_token_attention`, which
`load_pipeline` applies to the transformer it is given, keeps step 1's processor.

Loading under FSDP2 (`load_sharded_transformer`): the model is built from its config on the meta device (LoRA
injected there, its initial values computed exactly as the unsharded path computes them), parallelised, `to_empty`,
and every rank reads only its rows of each tensor from the diffusers safetensors (`safe_open(...).get_slice`).

Anchor (`build_sharded_anchor`): a frozen copy built on meta from the policy's config, parallelised with the
policy's settings (optionally offloaded to the CPU) and filled from the policy's local shards
(`sage_grpo.parallel.fsdp.ShardedAnchor`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from sage_grpo.models.sequence_parallel import enable_sequence_parallel
from sage_grpo.parallel.fsdp import ShardedAnchor, materialize_sharded, shard_modules

__all__ = [
    "BLOCK_LISTS",
    "transformer_blocks",
    "parallelize",
    "build_meta_transformer",
    "load_sharded_transformer",
    "build_sharded_anchor",
]

# ModuleLists whose entries are the FSDP2 units (attribute paths inside HunyuanVideo15Transformer3DModel).
BLOCK_LISTS = ("transformer_blocks", "context_embedder.token_refiner.refiner_blocks")


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


def parallelize(transformer: nn.Module, info, *, fsdp: bool = False, param_dtype: torch.dtype | None = None,
                master_dtype: torch.dtype | None = None, gradient_checkpointing: bool = False,
                offload: bool = False, compile: bool = False) -> nn.Module:
    """Sequence parallelism, activation checkpointing, compiled blocks (compile=True), then (fsdp=True) FSDP2 per
    block and at the root, in that order (module docstring) -> the same module.

    fsdp=True needs world size > 1 and works on a materialised module or a meta-device one (then
    `materialize_sharded`); param_dtype / master_dtype: the compute dtype (--dtype) and the master weights' (default:
    the parameters'); offload: keep the shards on the CPU (FSDP2 CPUOffloadPolicy, used by the frozen anchor).
    """
    # full inputs and outputs on every sp rank, partial gradients (summed over sp by FSDP2's divide factor dp, or by
    # `sage_grpo.parallel.dist.sync_gradients`)
    enable_sequence_parallel(transformer, info.sp_group)
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if compile:
        from sage_grpo.models.compile import compile_blocks

        compile_blocks(transformer)
    if fsdp:
        shard_modules(transformer, transformer_blocks(transformer), info, param_dtype=param_dtype,
                      master_dtype=master_dtype, offload=offload)
    return transformer


# ------------------------------------------------------------------------------------------------ meta-device builds


def _zero_storage_like(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of t's shape and dtype that owns one element (stride-0 view): shape-only stand-in."""
    return torch.zeros((), dtype=t.dtype).expand(t.shape)


def build_meta_transformer(config: dict, *, dtype: torch.dtype = torch.float32, lora: dict | None = None,
                           fp8: dict | None = None):
    """HunyuanVideo15Transformer3DModel from `config` on the meta device (no memory) in `dtype` (the master
    weights, as the unsharded path loads them before injecting LoRA) -> (model, lora_init).

    lora: setup_trainable's keyword arguments (use_lora=True, lora_r, ...) or None for full fine-tuning. The LoRA
    adapters are injected with the base weights present as zero-memory CPU stand-ins (stride-0 views), so peft
    creates and initialises them on the CPU exactly as in the unsharded path: the same draws from the global
    generator in the same order (the caller seeds it as post_train does), and a --pretrained_lora_path is loaded.
    `lora_init` = {name: full initial adapter tensor} (small), which `materialize_sharded` slices per rank; then the
    whole model (adapters included) is moved to meta so that fully_shard sees one device.
    fp8: {"fp8_matmul": bool} for an FP8 base (`sage_grpo.models.fp8`): the block linears become FP8Linear layers
    before LoRA wraps them, as `quantize_base` does before setup_trainable in the unsharded path.
    """
    from diffusers import HunyuanVideo15Transformer3DModel

    from sage_grpo.models.attention import use_valid_token_attention

    with torch.device("meta"):
        model = HunyuanVideo15Transformer3DModel.from_config(config).to(dtype)
    use_valid_token_attention(model)
    if fp8 is not None:
        from sage_grpo.models.fp8 import fp8_meta_base

        fp8_meta_base(model, fp8_matmul=fp8["fp8_matmul"])
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


def load_sharded_transformer(model_dir: str | Path, info, *, master_dtype: torch.dtype, param_dtype: torch.dtype,
                             base_dtype: torch.dtype | None = None, lora: dict | None = None,
                             fp8: dict | None = None, gradient_checkpointing: bool = False, compile: bool = False):
    """The policy transformer, parallelised (FSDP2-sharded), each rank reading only its rows -> (transformer,
    trainable params).

    model_dir: a diffusers `transformer/` directory (config.json + diffusion_pytorch_model*.safetensors).
    base_dtype: the stored dtype of the non-adapter weights (default master_dtype; with LoRA the compute dtype, the
    adapters then carry master_dtype through setup_trainable's adapter_dtype).
    lora: setup_trainable's keyword arguments ({"use_lora": ..., "lora_r": ..., ...}); call torch.manual_seed(seed)
    before, as for the unsharded path, and the adapters start identical. Returns the trainable parameters (DTensors)
    like setup_trainable.
    fp8: {"fp8_matmul": bool} for an FP8 base: each rank quantizes its rows of each block linear as it reads them
    (`sage_grpo.models.fp8.fp8_row_reader`), so no rank holds more bf16 than one tensor's rows.
    """
    from sage_grpo.models.loading import read_transformer_config, transformer_row_reader

    model_dir = Path(model_dir)
    if fp8 is not None and fp8["fp8_matmul"]:
        from sage_grpo.models.fp8 import check_fp8_matmul

        check_fp8_matmul(info.device)
    model, lora_init = build_meta_transformer(read_transformer_config(model_dir), dtype=base_dtype or master_dtype,
                                              lora=lora, fp8=fp8)
    parallelize(model, info, fsdp=True, param_dtype=param_dtype, master_dtype=master_dtype,
                gradient_checkpointing=gradient_checkpointing, compile=compile)
    with transformer_row_reader(model_dir) as rows:
        def unwrapped(name, start, stop):  # peft keeps a wrapped layer's weight under `.base_layer.`, the file not
            return rows(name.replace(".base_layer.", "."), start, stop)

        if fp8 is None:
            reader = unwrapped
        else:
            from sage_grpo.models.fp8 import fp8_row_reader

            reader = fp8_row_reader(unwrapped, base_dtype or master_dtype, info.device)

        materialize_sharded(model, info.device, reader, lora_init)
    model.eval()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, trainable


def build_sharded_anchor(policy: nn.Module, info, *, param_dtype: torch.dtype | None = None,
                         offload: bool = False) -> ShardedAnchor:
    """A frozen copy of the FSDP2 full-fine-tuning `policy`, built on meta from its config (no weights read),
    parallelised with the policy's settings (sequence parallelism, compiled blocks and attention backend included)
    and filled from its local shards."""
    from sage_grpo.models.attention import attention_backend_of, set_attention_backend
    from sage_grpo.models.compile import blocks_compiled

    master = next(policy.parameters()).dtype
    module, _ = build_meta_transformer(dict(policy.config), dtype=master)
    parallelize(module, info, fsdp=True, param_dtype=param_dtype or master, master_dtype=master, offload=offload,
                compile=blocks_compiled(policy))
    set_attention_backend(module, attention_backend_of(policy))
    return ShardedAnchor(module, policy, torch.device("cpu") if offload else info.device)
