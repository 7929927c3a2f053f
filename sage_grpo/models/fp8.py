"""An FP8 frozen base for LoRA (`--fp8_base`): the transformer blocks' linear weights stored in float8_e4m3fn with one
scale per output channel (torchao's `Float8WeightOnlyConfig`, PerRow), half the bytes of bf16; peft's LoRA wraps the
quantized layers (its `TorchaoLoraLinear`) and trains the adapters on top.

Compute: each layer's weight is dequantized to the dtype it was loaded in as the layer runs (any device), or, with
`--fp8_matmul`, the activations are quantized per row too and the product runs as an FP8 matrix product (torchao's
`Float8DynamicActivationFloat8WeightConfig`, PerRow; CUDA GPUs of compute capability 8.9 and above).

Only the linears of the 54 double-stream blocks (8.15B of the 8.33B parameters) are quantized: the embedders, the
text refiner, norm_out and proj_out (the velocity comes straight out of it) keep their weights, 0.35 GB in bf16.

The same quantized base serves every use of the policy: the rollout, the re-scoring, the LoRA anchor (the same module
with the adapter disabled or swapped) and `generate.py`. Quantization is deterministic (an absolute maximum, a
division and a rounding cast per row), so a resumed run re-quantizes the base from the weights files bitwise as
before and checkpoints keep only the adapter.
"""

from __future__ import annotations

import logging

import torch

from sage_grpo.errors import SageGRPOError

__all__ = ["FP8_MATMUL_CAPABILITY", "quantized_config", "quantize_base", "is_quantized", "quantized_bytes"]

FP8_MATMUL_CAPABILITY = (8, 9)  # Ada / Hopper and later have FP8 tensor cores (torch._scaled_mm)


def _torchao():
    """Import torchao quietly: on a CPU-only torch its CUDA kernel libraries fail to load with a warning each (they
    are not needed for the weight-only path), and its enums trip a deprecation warning of torch's pytree."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import torchao.quantization as q
    except ImportError:
        raise SageGRPOError("--fp8_base needs torchao: pip install 'sage-grpo[lora]' (or: pip install torchao)"
                            ) from None
    return q


def quantized_config(fp8_matmul: bool = False):
    """torchao's config: float8_e4m3fn weights with per-output-channel (PerRow) scales; weight-only (bf16 products)
    or, fp8_matmul, with dynamic per-row activation quantization (FP8 products). set_inductor_config=False: quantizing
    must not change torch.compile's global settings for the rest of the process."""
    q = _torchao()
    if fp8_matmul:
        return q.Float8DynamicActivationFloat8WeightConfig(granularity=q.PerRow(), set_inductor_config=False)
    return q.Float8WeightOnlyConfig(granularity=q.PerRow(), set_inductor_config=False)


def _check_fp8_matmul(device: torch.device) -> None:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < FP8_MATMUL_CAPABILITY:
        where = (f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
                 if device.type == "cuda" else f"the {device.type}")
        raise SageGRPOError(f"--fp8_matmul needs a CUDA GPU of compute capability 8.9 or above (FP8 tensor cores), "
                            f"not {where}; use --fp8_matmul False (the FP8 weights are then dequantized to bf16)")


def quantize_base(transformer: torch.nn.Module, device: torch.device | str | None = None, *,
                  fp8_matmul: bool = False) -> int:
    """Quantize the linear weights of `transformer.transformer_blocks` in place (before LoRA is injected) -> the
    number of layers quantized.

    device: each linear layer is moved there just before it is quantized (torchao's quantize_ moves module by
    module), so the device holds the FP8 blocks plus one bf16 layer, never the bf16 model; the caller moves the
    rest of the transformer afterwards. Biases keep their dtype.
    """
    device = torch.device(device) if device is not None else next(transformer.parameters()).device
    if fp8_matmul:
        _check_fp8_matmul(device)
    q = _torchao()
    blocks = transformer.transformer_blocks
    n = sum(isinstance(m, torch.nn.Linear) for m in blocks.modules())
    q.quantize_(blocks, quantized_config(fp8_matmul), device=device)
    return n


def is_quantized(transformer: torch.nn.Module) -> bool:
    """Whether any weight of `transformer` is a torchao quantized tensor."""
    try:
        from torchao.utils import TorchAOBaseTensor
    except ImportError:
        return False
    return any(isinstance(p, TorchAOBaseTensor) for p in transformer.parameters())


def quantized_bytes(numel_out: int, numel_in: int) -> int:
    """Bytes of one quantized [out, in] weight: one byte per element plus an fp32 scale per output channel."""
    return numel_out * numel_in + 4 * numel_out
