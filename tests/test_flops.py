"""The FLOP model (sage_grpo.flops) against torch's FlopCounterMode on real-width HunyuanVideo-1.5 blocks (meta
device: shapes only, instant), and the peak table."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from sage_grpo.flops import Flops, TransformerShape, block_flops, mfu, peak_tflops_of, transformer_flops
from sage_grpo.models.attention import ValidTokenAttnProcessor

REAL = TransformerShape()  # 16 x 128 heads, mlp 4, 54 blocks: diffusers' default = the real 480p transformer


def _real_blocks(n: int, lora_r: int):
    """n real-width dual-stream blocks on the meta device, valid-token processor; LoRA (peft) on every linear."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15TransformerBlock

    with torch.device("meta"):
        blocks = torch.nn.ModuleList(HunyuanVideo15TransformerBlock(16, 128, 4.0) for _ in range(n))
    for b in blocks:
        b.attn.set_processor(ValidTokenAttnProcessor())
    if lora_r:
        from peft import LoraConfig, inject_adapter_in_model

        targets = [name for name, m in blocks.named_modules() if isinstance(m, torch.nn.Linear)]
        blocks = inject_adapter_in_model(LoraConfig(r=lora_r, lora_alpha=lora_r, target_modules=targets), blocks)
        for name, p in blocks.named_parameters():
            p.requires_grad_("lora_" in name)
    return blocks


def _counted(blocks, batch: int, n_video: int, n_text: int, *, train: str | None, checkpointing: bool) -> Flops:
    """FlopCounterMode's count of the blocks run in a chain as the transformer runs them: forward, and for train the
    backward (with the recomputation inside it under checkpointing). Inputs need a gradient only where the transformer's
    do: full fine-tuning trains the embedders before the blocks (and the time embedding), LoRA does not."""
    d = REAL.hidden
    grad_in = train == "full"
    x = torch.randn(batch, n_video, d, device="meta", requires_grad=grad_in)
    enc = torch.randn(batch, n_text, d, device="meta", requires_grad=grad_in)
    temb = torch.randn(batch, d, device="meta", requires_grad=grad_in)
    rope = (torch.randn(n_video, 128, device="meta"), torch.randn(n_video, 128, device="meta"))
    lengths = (n_text,) * batch  # what the padding-cut hook hands each block
    with torch.set_grad_enabled(train is not None), FlopCounterMode(display=False) as fwd:
        for block in blocks:
            if checkpointing and train is not None:
                x, enc = checkpoint(block, x, enc, temb, lengths, rope, use_reentrant=False)
            else:
                x, enc = block(x, enc, temb, lengths, rope)
    if train is None:
        return Flops(forward=fwd.get_total_flops())
    with FlopCounterMode(display=False) as bwd:
        (x.sum() + enc.sum()).backward()
    forward = fwd.get_total_flops()
    recompute = forward if checkpointing else 0  # the counter sees the recomputation inside the backward
    return Flops(forward, recompute, bwd.get_total_flops() - recompute)


def _same(ours: int, counted: int):
    """The model counts what FlopCounterMode counts, exactly (not just within the 2 % asked of it)."""
    assert counted > 0
    assert ours == counted, (ours, counted, ours / counted)


@pytest.mark.parametrize("train,lora_r,checkpointing", [
    (None, 0, False), ("full", 0, False), ("full", 0, True), ("lora", 8, False), ("lora", 8, True), ("lora", 64, True),
])
def test_two_real_width_blocks_match_flop_counter(train, lora_r, checkpointing):
    """Two blocks in a chain (a LoRA run's first block gets inputs without gradient, as from the frozen embedders), a
    CFG-sized batch of 2, few tokens: the modulation and the adapters are a visible share, so the count must get
    them."""
    blocks = _real_blocks(2, lora_r)
    shape = TransformerShape(blocks=2)
    counted = _counted(blocks, 2, 24, 10, train=train, checkpointing=checkpointing)
    ours = transformer_flops(24, [10, 10], shape, train=train, lora_r=lora_r, checkpointing=checkpointing)
    _same(ours.forward, counted.forward)
    if train is not None:
        _same(ours.backward, counted.backward)
    assert ours.recompute == counted.recompute


def test_attention_dominates_at_rollout_size_and_matches():
    """One block at the real rollout's token count (18,018 video + 208 valid text tokens): attention is more than
    half of the forward, and the count still matches."""
    blocks = _real_blocks(1, 0)
    counted = _counted(blocks, 1, 18018, 208, train="full", checkpointing=False)
    fwd, bwd = block_flops(18018, 208, REAL, train="full")
    _same(fwd, counted.forward)
    _same(bwd, counted.backward)
    assert 4 * 18226**2 * 2048 > fwd / 2


def test_formula_of_the_docs():
    """The closed form docs/performance.md states: 2 L (4 D^2 + 2 D F) + 4 L^2 D + 24 D^2 per block forward."""
    d, f, n, t = 2048, 8192, 100, 30
    tokens = n + t
    assert block_flops(n, t, REAL) == (2 * tokens * (4 * d * d + 2 * d * f) + 4 * tokens**2 * d + 24 * d * d, 0)
    full = transformer_flops(n, [t], REAL, train="full", checkpointing=True)
    assert full.backward == 2 * full.forward  # full fine-tuning: backward = 2 x forward exactly
    assert full.recompute == full.forward and full.model == 3 * full.forward
    assert full.executed == 4 * full.forward


def test_video_tokens_and_shape_of_config():
    from sage_grpo.models.full_size import real_transformer_config

    shape = TransformerShape.of(real_transformer_config())
    assert shape == REAL
    assert shape.video_tokens(21, 22, 39) == 18018


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.4),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100-PCIE-40GB", 312.0), ("NVIDIA L40S", 362.05),
    ("NVIDIA L40", 181.05), ("NVIDIA L4", 121.0), ("NVIDIA A10", 125.0), ("NVIDIA GeForce RTX 4090", 165.2),
    ("NVIDIA H200 NVL", None), ("NVIDIA H100 NVL", None), ("NVIDIA GeForce RTX 3090", None), ("cpu", None),
])
def test_peak_table(name, peak):
    assert peak_tflops_of(name) == peak


def test_mfu():
    assert mfu(989.4e12, 2.0, 989.4) == pytest.approx(0.5)
    assert mfu(1e12, 1.0, None) is None
    assert mfu(1e12, 0.0, 100.0) is None


# ------------------------------------------------------------------------------------------------------ the meter


def _metered(train: str | None, *, image=False, checkpointing=False, sp_size=1, lora_r=0, adapters=True):
    """One call of the tiny transformer (valid-token attention) on a CFG-like batch under a FlopMeter -> (what the
    meter counted, the valid encoder tokens per sample, the shape)."""
    from helpers import IMG, attention_inputs, perturbed_transformer

    from sage_grpo.flops import FlopMeter
    from sage_grpo.models.attention import use_valid_token_attention
    from sage_grpo.models.lora import setup_trainable

    model = use_valid_token_attention(perturbed_transformer(torch.float32))
    setup_trainable(model, use_lora=bool(lora_r), lora_r=lora_r or 8)
    if train is None:
        model.requires_grad_(False)
    if checkpointing:
        model.enable_gradient_checkpointing()
    if not adapters:
        model.disable_adapters()
    meter = FlopMeter(lora_r=lora_r, sp_size=sp_size).attach(model)
    inputs = attention_inputs(torch.float32, txt_valid=(17, 3), b5_valid=(5, 1), image=image)
    model(**inputs)  # outside any phase: not counted
    meter.phase = "update"
    with torch.set_grad_enabled(train is not None):
        out = model(**inputs)[0]
    if train is not None:
        out.sum().backward()
    meter.phase = None
    text = [17 + 5 + IMG * image, 3 + 1 + IMG * image]
    return meter.take(), text, TransformerShape.of(model.config)


def test_meter_counts_a_forward_from_the_call_shapes():
    got, text, shape = _metered(None)
    assert text == [22, 4]
    assert got == {"update": transformer_flops(72, text, shape).model}  # 3 x 4 x 6 latent = 72 video tokens
    got, text, shape = _metered(None, image=True)  # image embeddings not all zero: the image tokens are valid
    assert got == {"update": transformer_flops(72, text, shape).model}


@pytest.mark.parametrize("lora_r", [0, 4])
def test_meter_counts_backward_not_recomputation(lora_r):
    train = "lora" if lora_r else "full"
    got, text, shape = _metered(train, checkpointing=True, lora_r=lora_r)
    want = transformer_flops(72, text, shape, train=train, lora_r=lora_r, checkpointing=True)
    assert want.recompute > 0 and got == {"update": want.model}


def test_meter_shares_an_sp_call_and_drops_disabled_adapters():
    got, text, shape = _metered(None, sp_size=2)
    assert got == {"update": transformer_flops(72, text, shape).model / 2}
    got, text, shape = _metered(None, lora_r=4, adapters=False)  # the fixed LoRA anchor: the base alone
    assert got == {"update": transformer_flops(72, text, shape).model}


def test_no_default_peak_on_the_cpu_or_for_fp32():
    from sage_grpo.flops import device_peak_tflops

    assert device_peak_tflops(0.0, torch.device("cpu"), "bf16") is None
    assert device_peak_tflops(0.0, torch.device("cuda"), "fp32") is None
    assert device_peak_tflops(312.0, torch.device("cpu"), "bf16") == 312.0
