"""An FP8 frozen base for LoRA (`--fp8_base`): the transformer blocks' linear weights stored in float8_e4m3fn with one
scale per output channel (torchao's `Float8WeightOnlyConfig`, PerRow), half the bytes of bf16; peft's LoRA wraps the
quantized layers (its `TorchaoLoraLinear`) and trains the adapters on top.

Compute: each layer's weight is dequantized to the dtype it was loaded in as the layer runs (any device), or, with
`--fp8_matmul`, the activations are quantized per row too and the product runs as an FP8 matrix product (torchao's
`Float8DynamicActivationFloat8WeightConfig`, PerRow; CUDA GPUs of compute capability 8.9 and above, bf16). That
product (torch._scaled_mm) has no derivative. On either path `_FP8Linear` gives the input's gradient from the weight
dequantized again in the backward, so that no dequantized copy is held from the forward to the backward.

Only the linears of the 54 double-stream blocks (8.15B of the 8.33B parameters) are quantized: the embedders, the
text refiner, norm_out and proj_out (the velocity comes straight out of it) keep their weights, 0.35 GB in bf16.

Storage (`FP8Linear`): torchao quantizes (its `quantize_` on each layer, or on a rank's rows of it) and computes
(`F.linear` on its `Float8Tensor`), but the quantized weight is kept as two plain parameters, the FP8 data as bytes
[out, in] (uint8) and the scales' bits [out, 1] (int32), from which the layer builds torchao's Float8Tensor (a
wrapper, no copy) each time it runs. Why not keep torchao's tensor as the parameter: FSDP2 cannot shard it (torchao
0.18's Float8Tensor has no all-gather extension and lacks the ops fully_shard runs on a parameter), while plain
integer tensors shard by rows like any weight, are all-gathered as bytes (FP8, half the traffic of bf16) and are
left alone by FSDP2's mixed precision (it casts floating parameters only: FP8 data and fp32 scales cast to bf16
would double the traffic and round the scales). Quantization is per output row, so a rank that quantizes its own
rows of a weight (`fp8_row_reader`, the sharded loader) gets exactly the rows of the whole weight's quantization.

The same quantized base serves every use of the policy: the rollout, the re-scoring, the LoRA anchor (the same module
with the adapter disabled or swapped) and `generate.py`. Quantization is deterministic (an absolute maximum, a
division and a rounding cast per row), so a resumed run re-quantizes the base from the weights files bitwise as
before and checkpoints keep only the adapter.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sage_grpo.errors import SageGRPOError

__all__ = ["FP8_MATMUL_CAPABILITY", "FP8Linear", "check_fp8_matmul", "quantized_config", "quantize_base",
           "quantize_rows", "fp8_meta_base", "fp8_row_reader", "dequantize_base", "is_quantized", "quantized_bytes"]

FP8_MATMUL_CAPABILITY = (8, 9)  # Ada / Hopper and later have FP8 tensor cores (torch._scaled_mm)
DATA, SCALE = "fp8_data", "fp8_scale_bits"  # FP8Linear's parameter names; the file holds `weight`


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


def check_fp8_matmul(device: torch.device) -> None:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < FP8_MATMUL_CAPABILITY:
        where = (f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
                 if device.type == "cuda" else f"the {device.type}")
        raise SageGRPOError(f"--fp8_matmul needs a CUDA GPU of compute capability 8.9 or above (FP8 tensor cores), "
                            f"not {where}; use --fp8_matmul False (the FP8 weights are then dequantized to bf16)")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a weight [rows, in] -> (FP8 data as bytes [rows, in] uint8, scale bits [rows, 1] int32): FP8Linear's
    two parameters, through torchao's `quantize_` with the weight-only config on a layer holding the rows. Both
    configs quantize the weight alike (`Float8Tensor.from_hp`, e4m3, PerRow, the same kernel preference); the FP8
    products' config adds only how the layer runs (`_layout`), and would leave rows that are no multiple of 16
    unquantized, which a rank's share of a weight need not be. Per row: the rows of a weight quantize as they would
    inside the whole weight.

    A row whose scale comes out 0 (all zeros; torchao 0.18 divides it by its absolute maximum, 0 / 0) would hold NaN
    bytes (0xFF) and make its output channel NaN for every input, where the unquantized layer gives the bias: its
    bytes are written 0 and its scale 1, which dequantize to the row's zeros exactly (any positive scale would).
    Every other row keeps torchao's bytes and scale."""
    q = _torchao()
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    q.quantize_(layer, quantized_config(False))
    data, scale = layer.weight.qdata.view(torch.uint8), layer.weight.scale.to(torch.float32)
    empty = scale == 0  # [rows, 1]
    data, scale = data.masked_fill(empty, 0), scale.masked_fill(empty, 1.0)
    return data, scale.view(torch.int32)


@functools.cache
def _layout(fp8_matmul: bool) -> dict:
    """The Float8Tensor attributes besides its data, scales, block size and dtype: none for the weight-only config;
    for FP8 products the matmul config, the activation quantization and the kernel preference, from the config's
    fields exactly as torchao's `_float8_dynamic_activation_float8_weight_quantize_tensor` (0.18) passes them to
    `Float8Tensor.from_hp` (read here without quantizing, which torchao refuses off an FP8 GPU)."""
    _torchao()
    from torchao.quantization.quantize_.common import KernelPreference
    from torchao.quantization.quantize_.workflows import QuantizeTensorToFloat8Kwargs

    if not fp8_matmul:  # Float8WeightOnlyConfig: from_hp's defaults
        return {"mm_config": None, "act_quant_kwargs": None, "kernel_preference": KernelPreference.AUTO}

    c = quantized_config(True)
    activation, _ = c.granularity
    act = QuantizeTensorToFloat8Kwargs(c.activation_dtype, activation, hp_value_lb=c.activation_value_lb,
                                       hp_value_ub=c.activation_value_ub, kernel_preference=c.kernel_preference)
    return {"mm_config": c.mm_config, "act_quant_kwargs": act, "kernel_preference": c.kernel_preference}


def _float8(data: torch.Tensor, scale_bits: torch.Tensor, dtype: torch.dtype, layout: dict):
    """torchao's Float8Tensor over FP8Linear's two parameters (views, no copy)."""
    from torchao.quantization import Float8Tensor

    return Float8Tensor(data.view(torch.float8_e4m3fn), scale_bits.view(torch.float32),
                        block_size=[1, data.shape[1]], dtype=dtype, **layout)


class _FP8Linear(torch.autograd.Function):
    """x W^T + b on FP8Linear's two parameters, torchao's product of the layout (weight-only: x @ dequantize(W)^T;
    --fp8_matmul: x quantized per row, torch._scaled_mm), saving only those parameters (the FP8 bytes and scales,
    storage the layer holds anyway) for the backward, where dL/dx = dL/dy W comes from the weight dequantized again.

    Why: run through autograd, torchao's weight-only product keeps each layer's dequantized weight (the compute dtype,
    twice the FP8 bytes) from the forward to the backward for every layer whose input needs a gradient: 0.19 GiB a
    block at the real width, all 54 blocks' without activation checkpointing. Dequantizing again costs one pass over
    the bytes. torch._scaled_mm has no derivative at all. No weight or bias gradient: the base is frozen (the LoRA
    adapters beside the layer get theirs on their own path)."""

    @staticmethod
    def forward(ctx, x, data, scale_bits, bias, dtype, layout):
        ctx.save_for_backward(data, scale_bits)
        ctx.dtype, ctx.x_dtype, ctx.layout = dtype, x.dtype, layout
        return F.linear(x, _float8(data, scale_bits, dtype, layout), bias)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        data, scale_bits = ctx.saved_tensors
        # the layer's own layout (read once, free of lookups that torch.compile cannot trace): dequantize reads only
        # the bytes, the scales and the dtype
        weight = _float8(data, scale_bits, ctx.dtype, ctx.layout).dequantize()  # [out, in], freed on return
        return (grad.to(weight.dtype) @ weight).to(ctx.x_dtype), None, None, None, None, None


class FP8Linear(nn.Linear):
    """A frozen linear layer whose weight is torchao's per-row FP8 quantization (module docstring: why it is stored
    as two integer parameters). `weight` is the Float8Tensor built from them, so F.linear, peft's
    TorchaoLoraLinear on top and anything that reads a layer's weight see torchao's quantized weight.

    An nn.Linear subclass so that LoRA targets it (peft and `default_lora_targets` look for nn.Linear); its
    nn.Linear constructor is not run (no bf16 weight is ever allocated)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, *, dtype: torch.dtype,
                 fp8_matmul: bool = False, device=None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype, self.fp8_matmul = dtype, fp8_matmul
        self.layout = _layout(fp8_matmul)  # read once here: forward stays free of Python-side lookups (torch.compile)
        if fp8_matmul and (in_features % 16 or out_features % 16):
            raise SageGRPOError(f"--fp8_matmul: a linear layer of {in_features} -> {out_features} features is no "
                                "multiple of 16 on each side, which FP8 matrix products need; use --fp8_matmul False")
        self.register_parameter(DATA, nn.Parameter(torch.empty(out_features, in_features, dtype=torch.uint8,
                                                               device=device), requires_grad=False))
        self.register_parameter(SCALE, nn.Parameter(torch.empty(out_features, 1, dtype=torch.int32, device=device),
                                                    requires_grad=False))
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fp8_matmul: bool = False) -> FP8Linear:
        """The quantization of `linear` (on its device; its bias kept)."""
        w = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype=w.dtype,
                    fp8_matmul=fp8_matmul, device=w.device)
        data, scale = quantize_rows(w)
        with torch.no_grad():
            getattr(layer, DATA).copy_(data)
            getattr(layer, SCALE).copy_(scale)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.detach())
        return layer

    @property
    def weight(self):
        """torchao's Float8Tensor over this layer's parameters (views: FSDP2's gathered ones while it runs)."""
        return _float8(getattr(self, DATA), getattr(self, SCALE), self.compute_dtype, self.layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FP8Linear.apply(x, getattr(self, DATA), getattr(self, SCALE), self.bias, self.compute_dtype,
                                self.layout)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"float8_e4m3fn per row, compute {self.compute_dtype}" + (", FP8 matmul" if self.fp8_matmul else ""))


def _block_linears(transformer: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) of every plain nn.Linear inside `transformer.transformer_blocks`."""
    return [(parent, name, child) for parent in transformer.transformer_blocks.modules()
            for name, child in parent.named_children() if type(child) is nn.Linear]


def quantize_base(transformer: nn.Module, device: torch.device | str | None = None, *,
                  fp8_matmul: bool = False) -> int:
    """Replace the linear layers of `transformer.transformer_blocks` by their FP8Linear quantization, in place
    (before LoRA is injected) -> the number of layers quantized.

    device: each layer is moved there just before it is quantized, so the device holds the FP8 blocks plus one bf16
    layer, never the bf16 model; the caller moves the rest of the transformer afterwards.
    """
    device = torch.device(device) if device is not None else next(transformer.parameters()).device
    if fp8_matmul:
        check_fp8_matmul(device)
    layers = _block_linears(transformer)
    for parent, name, layer in layers:
        setattr(parent, name, FP8Linear.from_linear(layer.to(device), fp8_matmul))
        layer.to("meta")  # its bf16 weight is freed now, not when the loop ends
    return len(layers)


def fp8_meta_base(transformer: nn.Module, *, fp8_matmul: bool = False) -> int:
    """`quantize_base` for a transformer on the meta device (the FSDP2 loader's): the block linears become meta
    FP8Linear layers, which `fp8_row_reader` fills -> the number of layers replaced."""
    layers = _block_linears(transformer)
    for parent, name, layer in layers:
        setattr(parent, name, FP8Linear(layer.in_features, layer.out_features, layer.bias is not None,
                                        dtype=layer.weight.dtype, fp8_matmul=fp8_matmul, device="meta"))
    return len(layers)


def fp8_row_reader(rows: Callable[[str, int, int], torch.Tensor], dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> Callable[[str, int, int], torch.Tensor]:
    """A row reader (name, start, stop) -> rows, for a model with FP8Linear layers: their parameters' rows are the
    quantization of the same rows of the stored `weight`, cast to the base's `dtype` first (as the one-process path
    loads the weights in it before quantizing) and quantized on `device` (one tensor's rows at a time, so the bf16
    model is never whole in memory); every other name is passed to `rows`."""
    last: dict = {}

    def read(name: str, start: int, stop: int) -> torch.Tensor:
        layer, _, leaf = name.rpartition(".")
        if leaf not in (DATA, SCALE):
            return rows(name, start, stop)
        key = (layer, start, stop)
        if last.get("key") != key:  # the data and the scales of one layer come from one quantization
            last["key"] = key
            last["value"] = quantize_rows(rows(f"{layer}.weight", start, stop).to(device=device, dtype=dtype))
        return last["value"][0 if leaf == DATA else 1]

    return read


def dequantize_base(transformer: nn.Module) -> int:
    """Replace every FP8Linear of `transformer` by a plain nn.Linear holding its weight dequantized to the layer's
    compute dtype (torchao's dequantize: the weight each forward of the layer computes with) and its bias, in place
    -> the number of layers replaced. An FP8 run trained its adapter beside this base, Q(W), not beside the
    unquantized W: scripts/export_checkpoint.py merges the adapter into it, so that the export is the trained model."""
    layers = [(parent, name, child) for parent in transformer.modules() for name, child in parent.named_children()
              if isinstance(child, FP8Linear)]
    for parent, name, layer in layers:
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        plain.weight = nn.Parameter(layer.weight.dequantize(), requires_grad=False)
        if layer.bias is not None:
            plain.bias = nn.Parameter(layer.bias.detach(), requires_grad=False)
        setattr(parent, name, plain)
    return len(layers)


def is_quantized(transformer: nn.Module) -> bool:
    """Whether `transformer` holds FP8Linear layers."""
    return any(isinstance(m, FP8Linear) for m in transformer.modules())


def quantized_bytes(numel_out: int, numel_in: int) -> int:
    """Bytes of one quantized [out, in] weight: one byte per element plus an fp32 scale per output channel (what an
    FP8Linear stores, tested against its parameters: the count a memory plan of an FP8 base needs)."""
    return numel_out * numel_in + 4 * numel_out
