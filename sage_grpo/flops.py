"""FLOPs of the HunyuanVideo-1.5 transformer from shapes only, and the MFU they give against a device's peak.

The model (one multiply-add = 2 FLOPs; what `torch.utils.flop_counter.FlopCounterMode` counts for matrix products,
checked against it at real width in tests/test_flops.py). Per sample and dual-stream block, with D = heads x
head_dim (2048), F = mlp_ratio x D (8192), N video tokens and T valid encoder tokens (image + ByT5 + MLLM), L = N + T:

    linear layers  2 L (4 D^2 + 2 D F)    each stream's q, k, v, out projections and its feed-forward, on its tokens
    attention      4 L^2 D                QK^T and PV over the sample's valid tokens (all heads)
    modulation     2 x 2 D 6D             the two AdaLayerNormZero linears on the time embedding, once per sample

so a block's forward is 2 L (4 D^2 + 2 D F) + 4 L^2 D + 24 D^2, and the transformer's the sum over its blocks and the
batch's samples. Padding does not count: a CFG pair of different text lengths runs its text-stream layers on the
longer length (the padding cut keeps the batch's longest), but only each sample's own valid tokens are the model's
work. The embedders, the token refiner and the output layer are left out (about 0.1 % at the rollout size).

Backward: a linear layer's weight gradient (trained weights only) and its input gradient (when its input needs one)
cost one forward each. Attention's backward is 2x its forward (dQ, dK, dV and dP: four products of the forward's
size; a fused kernel's recomputation of the scores is the kernel's own work, not the model's). So:
- full fine-tuning: every linear's weight gradient; input gradients everywhere (the time embedding is trained, so the
  modulation's too): backward = 2 x forward;
- LoRA (rank r on every block linear, the default targets): the frozen base weights have no weight gradient, only
  the input gradient, and none where the input needs no gradient: the modulation's (the time embedding is frozen).
  Every other linear's input does, even in the first block, whose inputs come from frozen embedders: its adapted
  modulation scales them. Each adapter (D_in -> r -> D_out) costs 2 (D_in r + r D_out) per token forward and its
  weight and input gradients backward;
- gradient checkpointing recomputes every block's forward once in the backward.

`Flops` keeps the three apart. MFU counts the model FLOPs (forward + backward, as PaLM's definition): the
recomputation is work that checkpointing adds, so it lowers MFU rather than raising it; `Flops.executed` counts it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "TransformerShape",
    "Flops",
    "linear_flops",
    "block_flops",
    "transformer_flops",
    "PEAK_BF16_TFLOPS",
    "peak_tflops_of",
    "mfu",
    "device_peak_tflops",
    "FlopMeter",
]


@dataclass(frozen=True)
class TransformerShape:
    """What the FLOP count needs of a HunyuanVideo15Transformer3DModel config."""

    hidden: int = 2048  # heads x head_dim
    mlp_ratio: float = 4.0
    blocks: int = 54
    patch: tuple[int, int, int] = (1, 1, 1)  # (t, h, w)

    @classmethod
    def of(cls, config) -> TransformerShape:
        """From a diffusers config (attribute or mapping access)."""
        get = config.get if isinstance(config, dict) else lambda k: getattr(config, k)
        return cls(hidden=get("num_attention_heads") * get("attention_head_dim"), mlp_ratio=float(get("mlp_ratio")),
                   blocks=get("num_layers"), patch=(get("patch_size_t"), get("patch_size"), get("patch_size")))

    @property
    def ffn(self) -> int:
        return int(self.hidden * self.mlp_ratio)

    def video_tokens(self, frames: int, height: int, width: int) -> int:
        """Latent [F, H, W] -> tokens after the patch embedding."""
        pt, ph, pw = self.patch
        return (frames // pt) * (height // ph) * (width // pw)


@dataclass(frozen=True)
class Flops:
    """FLOPs of some transformer work: forward, the checkpointed recomputation and the backward."""

    forward: int = 0
    recompute: int = 0
    backward: int = 0

    @property
    def model(self) -> int:
        """The model's FLOPs (what MFU counts): forward + backward."""
        return self.forward + self.backward

    @property
    def executed(self) -> int:
        """Everything run, the recomputation included."""
        return self.forward + self.recompute + self.backward

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.forward + other.forward, self.recompute + other.recompute, self.backward + other.backward)

    def __mul__(self, k: int) -> Flops:
        return Flops(self.forward * k, self.recompute * k, self.backward * k)


def linear_flops(tokens: int, d_in: int, d_out: int, *, train: str | None, lora_r: int = 0,
                 input_grad: bool = True) -> tuple[int, int]:
    """(forward, backward) FLOPs of one linear layer on `tokens` rows. train: None (no backward), "full" (the weight
    is trained) or "lora" (the weight is frozen; an adapter of rank lora_r beside it is trained). input_grad: whether
    the layer's input needs a gradient (its producer is trained, directly or upstream)."""
    base = 2 * tokens * d_in * d_out
    if train is None:
        return base + (2 * tokens * lora_r * (d_in + d_out) if lora_r else 0), 0
    if train == "full":
        return base, base + (base if input_grad else 0)
    if train != "lora":
        raise ValueError(f"train must be None, 'full' or 'lora', got {train!r}")
    a, b = 2 * tokens * d_in * lora_r, 2 * tokens * lora_r * d_out  # adapter A: d_in -> r, B: r -> d_out
    # base: input gradient only; A: weight gradient (+ input gradient); B: weight and input gradient (A is trained)
    backward = (base + a if input_grad else 0) + a + 2 * b
    return base + a + b, backward


def block_flops(n_video: int, n_text: int, shape: TransformerShape, *, train: str | None = None,
                lora_r: int = 0) -> tuple[int, int]:
    """(forward, backward) FLOPs of one dual-stream block for one sample of n_video video and n_text valid encoder
    tokens."""
    d, f = shape.hidden, shape.ffn
    tokens = n_video + n_text  # L: each token goes through its own stream's layers, the same sizes in both streams
    fwd = bwd = 0

    def add(n, d_in, d_out, input_grad):
        nonlocal fwd, bwd
        lf, lb = linear_flops(n, d_in, d_out, train=train, lora_r=lora_r, input_grad=input_grad)
        fwd, bwd = fwd + lf, bwd + lb

    # modulation: AdaLayerNormZero's linear D -> 6D on the time embedding [1, D], video and text stream
    for _ in range(2):
        add(1, d, 6 * d, train == "full")
    for _ in range(4):  # q, k, v and the out projection: [L, D] -> [L, D]
        add(tokens, d, d, True)
    add(tokens, d, f, True)  # feed-forward up [L, D] -> [L, F]
    add(tokens, f, d, True)  # and down
    attention = 4 * tokens * tokens * d  # QK^T [L, L] and PV [L, D], summed over heads
    fwd += attention
    if train is not None:
        bwd += 2 * attention
    return fwd, bwd


def transformer_flops(n_video: int, text_tokens: Sequence[int], shape: TransformerShape, *, train: str | None = None,
                      lora_r: int = 0, checkpointing: bool = False) -> Flops:
    """FLOPs of one transformer call on a batch: n_video video tokens per sample and text_tokens[i] valid encoder
    tokens of sample i. train None: a forward only (no_grad); "full" / "lora": forward and backward, plus the
    recomputation of every block's forward under gradient checkpointing."""
    total = Flops()
    for n_text in text_tokens:
        fwd, bwd = block_flops(n_video, n_text, shape, train=train, lora_r=lora_r)
        total = total + Flops(fwd, fwd if train is not None and checkpointing else 0, bwd) * shape.blocks
    return total


# Dense BF16 tensor-core peaks (TFLOP/s, no sparsity), from the vendors' datasheets, matched against
# torch.cuda.get_device_name() in this order (first match wins). The datasheets print the sparse figure with an
# asterisk; the dense one is half of it.
PEAK_BF16_TFLOPS: tuple[tuple[str, str, float, str], ...] = (
    # (name, regex on the device name, TFLOP/s, source)
    ("H100 SXM", r"H100(?!.*(PCIe|NVL))", 989.4, "NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOPS sparse"),
    ("H100 PCIe", r"H100.*PCIe", 756.0, "NVIDIA H100 datasheet: H100 PCIe BF16 1,513 TFLOPS sparse"),
    ("H200", r"H200(?!.*NVL)", 989.4, "NVIDIA H200 Tensor Core GPU datasheet: H200 SXM BF16 1,979 TFLOPS sparse"),
    ("A100", r"A100", 312.0, "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS (624 sparse)"),
    ("L40S", r"L40S", 362.05, "NVIDIA L40S datasheet: BF16 362.05 TFLOPS (733 sparse)"),
    ("L40", r"L40(?!S)", 181.05, "NVIDIA L40 datasheet: BF16 181.05 TFLOPS (362.1 sparse)"),
    ("L4", r"\bL4\b", 121.0, "NVIDIA L4 datasheet: BF16 242 TFLOPS sparse"),
    ("A10", r"\bA10\b", 125.0, "NVIDIA A10 datasheet: BF16 125 TFLOPS (250 sparse)"),
    ("RTX 4090", r"RTX 4090", 165.2, "NVIDIA Ada Lovelace architecture whitepaper, appendix A: GeForce RTX 4090 "
                                     "peak BF16 tensor TFLOPS with FP32 accumulate 165.2 (330.4 sparse)"),
)


def peak_tflops_of(device_name: str) -> float | None:
    """The dense BF16 peak of a device by its name (torch.cuda.get_device_name), None when not in the table."""
    for _, pattern, tflops, _source in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


def mfu(flop: float, seconds: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: flop / seconds against peak_tflops (None without a peak or a time)."""
    if not peak_tflops or seconds <= 0:
        return None
    return flop / seconds / (peak_tflops * 1e12)


def device_peak_tflops(peak_flag: float, device, dtype: str) -> float | None:
    """The peak MFU is computed against: --peak_tflops when > 0, else the table's dense bf16 peak of a CUDA device
    computing in bf16 or fp16 (the same figure on these cards); None (TFLOP/s only) on the CPU, for an unknown
    device or for fp32 compute."""
    if peak_flag > 0:
        return float(peak_flag)
    if getattr(device, "type", device) != "cuda" or dtype not in ("bf16", "fp16"):
        return None
    import torch

    return peak_tflops_of(torch.cuda.get_device_name(device))


class FlopMeter:
    """The model FLOPs of every call of the attached transformers, summed per phase (`phase`, set by the caller):
    a forward pre-hook reads the call's shapes: the latent [B, C, F, H, W] and the valid encoder tokens of each
    sample (MLLM and ByT5 masks, and the image tokens unless the image embeddings are all zero, as diffusers'
    forward decides). A call with gradients enabled on a module with trained parameters counts its backward too
    (every such call in the loop is followed by one) and, under gradient checkpointing, the recomputation.

    The valid counts stay on the device until `take()`, which reads all of a step's at once: no host sync per call.
    Under sequence parallelism every rank of an sp group makes the same call on the full inputs; each counts its
    1/sp share. A LoRA model whose adapters are disabled (the fixed LoRA anchor) counts without them."""

    def __init__(self, *, lora_r: int = 0, sp_size: int = 1):
        self.lora_r, self.sp_size = lora_r, sp_size
        self.phase: str | None = None
        # (phase, shape, n_video, valid counts [B] on the device, train, lora_r, checkpointing) per call
        self._pending: list = []
        self._handles: list = []

    def attach(self, transformer) -> FlopMeter:
        shape = TransformerShape.of(transformer.config)
        trained = any(p.requires_grad for p in transformer.parameters())
        train = ("lora" if self.lora_r else "full") if trained else None
        lora_layer = next((m for m in transformer.modules() if hasattr(m, "lora_A")), None)

        def pre(module, args, kwargs):
            if self.phase is None:
                return
            import torch

            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # [B, C, F, H, W]
            valid = kwargs["encoder_attention_mask"].sum(1)  # [B] valid MLLM tokens
            if kwargs.get("encoder_attention_mask_2") is not None:
                valid = valid + kwargs["encoder_attention_mask_2"].sum(1)  # and ByT5
            image = kwargs.get("image_embeds")  # [B, T_img, D_img]; all zero = text-to-video, no valid image tokens
            if image is not None:
                valid = valid + image.ne(0).any().long() * image.shape[1]
            r = 0 if lora_layer is None or lora_layer.disable_adapters else self.lora_r
            self._pending.append((self.phase, shape, shape.video_tokens(*x.shape[2:]), valid.detach(),
                                  train if torch.is_grad_enabled() else None, r,
                                  bool(getattr(module, "gradient_checkpointing", False))))

        self._handles.append(transformer.register_forward_pre_hook(pre, with_kwargs=True))
        return self

    def take(self) -> dict[str, float]:
        """{phase: model FLOPs of this rank} since the last take (one host sync for all the calls)."""
        import torch

        if not self._pending:
            return {}
        device = self._pending[0][3].device
        counts = torch.cat([p[3].reshape(-1).to(device) for p in self._pending]).tolist()
        out: dict[str, float] = {}
        i = 0
        for phase, shape, n_video, valid, train, r, ckpt in self._pending:
            texts = [int(n) for n in counts[i:i + valid.numel()]]
            i += valid.numel()
            f = transformer_flops(n_video, texts, shape, train=train, lora_r=r, checkpointing=ckpt)
            out[phase] = out.get(phase, 0.0) + f.model / self.sp_size
        self._pending.clear()
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
