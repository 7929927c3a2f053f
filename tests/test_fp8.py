"""--fp8_base (sage_grpo.models.fp8): the frozen base's block linears in float8_e4m3fn with per-output-channel
scales, LoRA (peft's TorchaoLoraLinear) on top: the quantization itself, its error at the real block width and on a
rollout, training (first ratio 1, resume bitwise), generate.py holding the trained policy, and the refusals."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys

import pytest
import torch
from post_train_helpers import ROOT, _args, pt
from safetensors.torch import load_file

from sage_grpo.checkpoint import list_checkpoints
from sage_grpo.config import load_config, validate
from sage_grpo.errors import SageGRPOError
from sage_grpo.models.fp8 import (  # torchao: the lora extra, which scripts/test.sh installs
    FP8Linear,
    is_quantized,
    quantize_base,
)
from sage_grpo.models.lora import merged_state_dict, setup_trainable


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _blocks(*blocks: torch.nn.Module) -> torch.nn.Module:
    """A stand-in transformer holding `blocks` as its transformer_blocks (what quantize_base quantizes), with
    diffusers' adapter methods (what setup_trainable calls)."""
    from diffusers.loaders import PeftAdapterMixin

    class Blocks(torch.nn.Module, PeftAdapterMixin):
        def __init__(self):
            super().__init__()
            self.transformer_blocks = torch.nn.ModuleList(blocks)

    return Blocks()


def test_the_block_linears_become_fp8_per_output_channel_deterministically(tiny_pipe):
    base = copy.deepcopy(tiny_pipe.transformer)
    linears = {n: m.weight.detach().clone() for n, m in base.named_modules()
               if isinstance(m, torch.nn.Linear) and n.startswith("transformer_blocks.")}
    others = {n: p.detach().clone() for n, p in base.named_parameters() if not n.startswith("transformer_blocks.")}
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    assert quantize_base(a, "cpu") == len(linears) > 0 and quantize_base(b, "cpu") == len(linears)
    assert is_quantized(a) and not is_quantized(base)
    assert _same_state(a.state_dict(), b.state_dict())  # a resume re-quantizes the base bitwise as before
    for n, w in linears.items():
        q = a.get_submodule(n).weight
        assert q.qdata.dtype == torch.float8_e4m3fn and q.scale.shape == (w.shape[0], 1)  # one scale per output row
        deq = q.qdata.float() * q.scale  # [out, in]
        normal = w.abs() >= w.abs().amax(1, keepdim=True) / 448 * 2 ** -6  # e4m3's normal range below each row's max
        assert ((deq - w).abs() <= w.abs() * 2 ** -4 + 1e-12)[normal].all()  # round to nearest of 3 mantissa bits
    assert all(torch.equal(p, others[n]) for n, p in a.named_parameters() if n in others)  # the rest untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_quantize_as_inside_the_whole_weight_and_the_sharded_loader_builds_the_same_policy(tiny_model, dtype):
    """Per-row scales: any split of a weight's rows quantizes bitwise as the whole weight (what lets each FSDP2 rank
    quantize only its rows); the meta-device build with the FP8 row reader (the sharded loader's path, here on one
    process) gives the policy of load + quantize_base + LoRA: the same bytes, the same adapters, the same output.
    The tiny model's file is fp32: with a bf16 base both paths quantize the bf16 weights (a quantization of the fp32
    ones differs in scales and bytes)."""
    from sage_grpo.models.fp8 import fp8_row_reader, quantize_rows
    from sage_grpo.models.loading import load_transformer, locate_model, transformer_row_reader
    from sage_grpo.models.parallelize import build_meta_transformer
    from sage_grpo.parallel.fsdp import materialize_sharded

    torch.manual_seed(0)
    w = (torch.randn(37, 24) * torch.logspace(-3, 1, 37)[:, None]).to(torch.bfloat16)  # rows of very different size
    whole = quantize_rows(w)
    for cut in (1, 16, 19, 36):
        parts = [quantize_rows(w[:cut]), quantize_rows(w[cut:])]
        assert all(torch.equal(torch.cat([p[i] for p in parts]), whole[i]) for i in range(2))

    lora = dict(use_lora=True, lora_r=4, lora_alpha=8, adapter_dtype=torch.float32)
    torch.manual_seed(3)
    ref = load_transformer(locate_model("", str(tiny_model)), dtype)
    n = quantize_base(ref, "cpu")
    setup_trainable(ref, **lora)
    torch.manual_seed(3)
    config = json.loads((tiny_model / "transformer" / "config.json").read_text())
    meta, init = build_meta_transformer(config, dtype=dtype, lora=lora, fp8={"fp8_matmul": False})
    reads = []
    with transformer_row_reader(tiny_model / "transformer") as rows:
        def counted(name, start, stop):
            reads.append(name)
            return rows(name.replace(".base_layer.", "."), start, stop)

        materialize_sharded(meta, "cpu", fp8_row_reader(counted, dtype), init)
    assert _same_state(meta.state_dict(), ref.state_dict()) and is_quantized(meta)
    fp8 = sorted(f"{name}.weight" for name, m in meta.named_modules() if isinstance(m, FP8Linear))
    assert len(fp8) == n and sorted(r for r in reads if r in fp8) == fp8  # each quantized weight read once
    x = torch.randn(1, 7, ref.config.num_attention_heads * ref.config.attention_head_dim, dtype=dtype)
    layer = "transformer_blocks.0.attn.to_q"
    assert torch.equal(meta.get_submodule(layer)(x), ref.get_submodule(layer)(x))
    with pytest.raises(ValueError, match="needs the unquantized base"):  # an adapter is merged into bf16 weights only
        merged_state_dict(ref)


def test_an_fp8_layer_compiles_without_a_graph_break():
    """--compile compiles each block whole: an FP8 layer's forward (torchao's tensor built from its two parameters)
    traces in one graph and gives the eager output."""
    from sage_grpo.models.fp8 import FP8Linear

    torch.manual_seed(0)
    layer = FP8Linear.from_linear(torch.nn.Linear(32, 16).to(torch.bfloat16))
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert torch.equal(torch.compile(layer, backend="aot_eager", fullgraph=True)(x), layer(x))


def test_fp8_products_quantize_the_activations_and_take_the_input_gradient_from_the_dequantized_weight():
    """--fp8_matmul's layer, run on the CPU (torch._scaled_mm exists there; the flag itself is refused off an FP8 GPU):
    the forward is the scaled FP8 product of the per-row quantized activations and the layer's FP8 weight; the
    backward, which torch._scaled_mm lacks, gives dL/dx = dL/dy W from the dequantized weight; LoRA on it trains."""
    from torchao.quantization import Float8Tensor, PerRow

    from sage_grpo.models.fp8 import FP8Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    layer, weight_only = FP8Linear.from_linear(lin, fp8_matmul=True), FP8Linear.from_linear(lin)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)  # [3, 5, 32]
    xq = Float8Tensor.from_hp(x.detach().reshape(15, 64), granularity=PerRow())
    w = layer.weight
    product = torch._scaled_mm(xq.qdata, w.qdata.t(), scale_a=xq.scale, scale_b=w.scale.t(), bias=lin.bias,
                               out_dtype=torch.bfloat16, use_fast_accum=True)
    assert torch.equal(y.detach().reshape(15, 32), product)
    assert not torch.equal(y.detach(), weight_only(x.detach()))  # the weight-only layer keeps bf16 activations
    assert _rel(y.detach(), lin(x.detach())) < 0.05  # e4m3 on both sides: 3.5 % for random values
    grad = torch.randn_like(y)
    y.backward(grad)
    dequantized = w.qdata.float() * w.scale  # [out, in]
    assert _rel(x.grad, grad.float() @ dequantized) < 1e-2 and x.grad.dtype == torch.bfloat16  # bf16 rounding

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = FP8Linear.from_linear(lin, fp8_matmul=True)

    model = _blocks(Block())
    params = setup_trainable(model, use_lora=True, lora_r=4, lora_alpha=4, adapter_dtype=torch.float32)
    out = model.transformer_blocks[0].proj(x.detach())
    out.float().pow(2).mean().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)  # lora_B's gradient (A is random)


def test_a_zero_weight_row_gives_the_bias_not_nan():
    """An all-zero weight row (a pruned or zero-initialised output channel) has the absolute maximum 0: torchao's
    scale 0 and bytes 0 / 0 (NaN, 0xFF) would make that channel NaN for every input, where the unquantized layer gives
    its bias. It quantizes to zero bytes, in both products; every other row keeps torchao's own bytes and scale."""
    from torchao.quantization import quantize_

    from sage_grpo.models.fp8 import DATA, SCALE, quantize_rows, quantized_config

    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight[3] = 0
    ref = copy.deepcopy(lin)
    quantize_(ref, quantized_config(False))
    rest = torch.arange(16) != 3
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    for fp8_matmul in (False, True):  # the FP8 products run on the CPU too (torch._scaled_mm)
        layer = FP8Linear.from_linear(lin, fp8_matmul=fp8_matmul)
        y = layer(x)
        assert torch.isfinite(y).all() and torch.equal(y[:, 3], lin.bias[3].expand(5)), fp8_matmul
        assert torch.equal(getattr(layer, DATA)[3], torch.zeros(32, dtype=torch.uint8))
        assert torch.equal(getattr(layer, DATA)[rest], ref.weight.qdata.view(torch.uint8)[rest])
        assert torch.equal(getattr(layer, SCALE).view(torch.float32)[rest], ref.weight.scale[rest])
    data, scale = quantize_rows(torch.zeros(4, 8, dtype=torch.bfloat16))  # a whole zero weight (or a rank's rows)
    assert not data.any() and torch.equal(scale.view(torch.float32), torch.ones(4, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_layer_keeps_no_dequantized_weight_for_the_backward(dtype):
    """torchao's weight-only product, run through autograd (F.linear on its Float8Tensor), keeps the dequantized
    weight (the compute dtype: twice the FP8 bytes in bf16) from the forward to the backward of every layer whose
    input needs a gradient, 12 of a block's 14 at 0.19 GiB a real-width block. The layer saves its FP8 bytes and
    scales only (its own parameters: no new memory) and dequantizes again in the backward; its forward and its input
    gradient are torchao's product's bitwise, under a LoRA adapter too (what training runs)."""
    from sage_grpo.models.fp8 import DATA, SCALE

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48).to(dtype)
    layer = FP8Linear.from_linear(lin)
    x = torch.randn(3, 5, 64, dtype=dtype, requires_grad=True)
    grad = torch.randn(3, 5, 48, dtype=dtype)

    def saved_by(fn):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = fn(x)
        return y, [t for t in saved if t.dtype == dtype and t.numel() == lin.weight.numel()]  # a weight's copy

    ref, ref_weights = saved_by(lambda v: torch.nn.functional.linear(v, layer.weight, layer.bias))  # torchao's path
    (ref_dx,) = torch.autograd.grad(ref, x, grad)
    assert [tuple(t.shape) for t in ref_weights] == [(64, 48)]  # what the check below finds: dequantize(W)^T
    y, weights = saved_by(layer)
    (dx,) = torch.autograd.grad(y, x, grad)
    assert torch.equal(y, ref) and torch.equal(dx, ref_dx) and not weights
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x)
    params = {getattr(layer, DATA).data_ptr(), getattr(layer, SCALE).data_ptr()}
    assert {t.data_ptr() for t in saved} == params  # the layer's own storage: nothing allocated for the backward

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = FP8Linear.from_linear(lin)

    model = _blocks(Block())
    setup_trainable(model, use_lora=True, lora_r=4, lora_alpha=4, adapter_dtype=torch.float32)
    _, weights = saved_by(model.transformer_blocks[0].proj)
    assert not weights
    if dtype == torch.bfloat16:  # --fp8_matmul saves the same (bf16 only)
        _, weights = saved_by(FP8Linear.from_linear(lin, fp8_matmul=True))
        assert not weights


def test_quantized_bytes_is_what_an_fp8_layer_stores():
    """sage_grpo.models.fp8.quantized_bytes (for counting an FP8 base's bytes) against a layer's real storage."""
    from sage_grpo.models.fp8 import quantized_bytes

    layer = FP8Linear.from_linear(torch.nn.Linear(24, 40, bias=False).to(torch.bfloat16))
    assert quantized_bytes(40, 24) == sum(p.untyped_storage().nbytes() for p in layer.parameters()) == 40 * 24 + 160


def test_fp8_products_need_multiples_of_16():
    from sage_grpo.models.fp8 import FP8Linear

    with pytest.raises(SageGRPOError, match="no multiple of 16"):
        FP8Linear.from_linear(torch.nn.Linear(24, 32).to(torch.bfloat16), fp8_matmul=True)


@pytest.mark.slow
def test_a_real_width_block_trains_lora_on_its_fp8_base_and_its_error_is_stated():
    """One HunyuanVideo-1.5 double-stream block at the real width (16 x 128 heads, 151M parameters, random N(0,
    0.02^2) weights as in sage_grpo.models.full_size), 64 video and 16 text tokens in bf16: the FP8 block's output
    against the bf16 block's (docs/performance.md states the number), then LoRA on the FP8 layers learns."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15TransformerBlock

    from sage_grpo.models.full_size import REAL_BLOCK_PARAMS

    torch.manual_seed(0)
    with torch.device("meta"):
        block = HunyuanVideo15TransformerBlock(16, 128, mlp_ratio=4.0, qk_norm="rms_norm")
    block = block.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for n, p in block.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in n and p.ndim == 1 else torch.randn_like(p) * 0.02)
    assert sum(p.numel() for p in block.parameters()) == REAL_BLOCK_PARAMS
    x, text, temb = (torch.randn(1, n, 2048, dtype=torch.bfloat16) for n in (64, 16, 1))
    temb, mask = temb[:, 0], torch.ones(1, 16, dtype=torch.bool)  # every text token valid
    with torch.no_grad():
        ref, ref_text = block(x, text, temb, mask)
    fp8 = _blocks(copy.deepcopy(block).requires_grad_(False))
    quantize_base(fp8, "cpu")
    with torch.no_grad():
        out, out_text = fp8.transformer_blocks[0](x, text, temb, mask)
    err = _rel(out - x, ref - x)  # the block's update of the residual stream (its output less its input)
    assert 0.01 < err < 0.06, err  # e4m3 rounding of random weights: 3.7 % for 2 chained random layers
    print(f"real-width block, FP8 base against bf16: relative error {err:.4f} (residual update), "
          f"{_rel(out, ref):.2e} (output), {_rel(out_text - text, ref_text - text):.4f} (text update)")
    params = setup_trainable(fp8, use_lora=True, lora_r=4, lora_alpha=4, lora_target_modules=["to_q", "to_v"],
                             adapter_dtype=torch.float32)
    assert type(fp8.transformer_blocks[0].attn.to_q).__name__ == "TorchaoLoraLinear"
    opt = torch.optim.SGD(params, lr=0.5)
    target = torch.zeros_like(x)
    losses = []
    for _ in range(3):
        out, _ = fp8.transformer_blocks[0](x, text, temb, mask)
        loss = (out.float() - target.float()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in params if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    assert losses[2] < losses[0], losses


def test_a_rollout_on_the_fp8_base_stays_close_to_the_bf16_one(tiny_pipe, text_cache):
    """The same noise, the same 4-step SDE rollout: the final latents of the FP8 base against the unquantized base
    (the tiny model, fp32 compute; docs/performance.md states the number)."""
    from test_rollout import _run

    from sage_grpo.rollout import SamplerSettings

    settings = SamplerSettings(sde_type="sage_grpo", eta=0.5, num_steps=4, shift=3.0, cfg_scale=1.0)
    ref = _run(tiny_pipe, text_cache, settings).latents[:, -1]
    original = tiny_pipe.transformer
    tiny_pipe.transformer = copy.deepcopy(original)
    try:
        quantize_base(tiny_pipe.transformer, "cpu")
        out = _run(tiny_pipe, text_cache, settings).latents[:, -1]
    finally:
        tiny_pipe.transformer = original
    err = _rel(out, ref)
    assert 0 < err < 0.05, err
    print(f"4-step rollout on the tiny model, FP8 base against fp32: final latent relative error {err:.4f}")


@pytest.fixture(scope="module")
def fp8_run(tiny_model, tmp_path_factory):
    """A 2-step --fp8_base LoRA run saving at every step -> (output dir, the policy it trained, the flags)."""
    out = tmp_path_factory.mktemp("fp8") / "run"
    extra = ["--use_lora", "--fp8_base", "--lora_r", "4", "--lora_alpha", "8", "--learning_rate", "1e-2",
             "--update_ref_model_step", "2", "--kl_warmup_updates", "1", "--kl_weight", "1e-2",
             "--kl_coef", "1e-3", "--kl_min_coef", "1e-4"]
    policies = []
    orig = pt.load_policy

    def load_policy(*a):  # the run's own transformer, to compare with what generate.py loads
        policies.append(orig(*a))
        return policies[-1]

    pt.load_policy = load_policy
    try:
        pt.main(_args(tiny_model, out, "--save_interval", "1", *extra))
    finally:
        pt.load_policy = orig
    return out, policies[0][0], extra


@pytest.mark.slow
def test_an_fp8_lora_run_trains_with_first_ratio_one_and_resumes_bitwise(tiny_model, fp8_run, tmp_path):
    out, policy, extra = fp8_run
    assert is_quantized(policy)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the rollout and the re-scoring run the same FP8 base: the first update's ratio is exactly 1
    assert rows[0]["train/ratio_min"] == rows[0]["train/ratio_max"] == 1.0 and rows[0]["train/grad_norm"] > 0
    assert rows[1]["kl/pos"] > 0  # the moving anchor (the same FP8 base, the adapter swapped) saw the update
    ckpts = dict(list_checkpoints(out))
    assert sorted(ckpts) == [1, 2] and not (ckpts[2] / "transformer").exists()  # the adapter only
    trained = load_file(ckpts[2] / "lora" / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in trained.items())
    half = tmp_path / "half"
    shutil.copytree(ckpts[1], half / ckpts[1].name)
    (half / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    pt.main(_args(tiny_model, half, "--save_interval", "1", *extra, "--resume_from_checkpoint", "latest"))
    resumed = load_file(list_checkpoints(half)[-1][1] / "lora" / "adapter_model.safetensors")
    assert trained.keys() == resumed.keys() and all(torch.equal(trained[k], resumed[k]) for k in trained)
    stable = [{k: v for k, v in json.loads(line).items() if not k.startswith(("perf/", "mem/"))}
              for f in (out, half) for line in (f / "metrics.jsonl").read_text().splitlines()[1:]]
    assert stable[0] == stable[1]


@pytest.mark.slow
def test_generate_from_an_fp8_run_holds_the_policy_it_trained(tiny_model, fp8_run, tmp_path, monkeypatch):
    """generate.py --checkpoint_path of an --fp8_base run: the base quantized bitwise as in training and the adapter
    beside it unmerged (the run's own setting; --fp8_base False merges it into the bf16 base instead)."""
    from helpers import load_script

    import sage_grpo.generation as generation

    out, policy, _ = fp8_run
    held = {}

    def sample_videos(pipe, *a, **kw):  # the loaded policy; no sampling needed
        held["state"] = {k: v for k, v in pipe.transformer.state_dict().items()}
        return iter(())

    monkeypatch.setattr(generation, "sample_videos", sample_videos)
    generate = load_script("generate.py")
    common = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--model_path", str(tiny_model), "--prompt", "a ball",
              "--output_path", str(tmp_path / "v.mp4"), "--checkpoint_path", str(list_checkpoints(out)[-1][1])]
    generate.main(common)
    assert _same_state(held["state"], policy.state_dict())
    generate.main([*common, "--fp8_base", "False"])
    assert not any("lora_" in k or "fp8_" in k for k in held["state"]) and is_quantized(policy)


@pytest.mark.slow
def test_the_export_of_an_fp8_run_is_the_policy_it_trained(tiny_model, fp8_run, tiny_pipe, text_cache, tmp_path,
                                                           capsys):
    """scripts/export_checkpoint.py on the --fp8_base run: its adapter merged into the FP8 base dequantized, Q(W) +
    BA, whose rollout (loaded as generate.py --checkpoint_path loads an export) is the trained policy's to fp32
    rounding, and so is --merge_lora False's dequantized base with the adapter beside it; the adapter merged into the
    unquantized base, W + BA, is another model (by the base's quantization error). The log and the card say which."""
    from helpers import load_script
    from test_rollout import _run

    from sage_grpo.models.loading import load_transformer, locate_model
    from sage_grpo.models.lora import load_trained_weights, merge_adapter
    from sage_grpo.rollout import SamplerSettings

    out, policy, _ = fp8_run
    ckpt = list_checkpoints(out)[-1][1]
    export = load_script("scripts/export_checkpoint.py")
    merged = export.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "merged")])
    log = capsys.readouterr().out
    assert "an --fp8_base run: its adapter merged into the FP8 base dequantized (Q(W) + BA" in log, log
    unmerged = export.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "unmerged"), "--merge_lora", "False"])
    assert "its adapter beside the FP8 base dequantized" in capsys.readouterr().out
    card = (merged / "README.md").read_text()
    assert "These base weights are that FP8 base dequantized, with the adapter merged" in card, card
    assert "the adapter beside them in `lora/`" in (unmerged / "README.md").read_text()

    def base():
        return load_transformer(locate_model("", str(tiny_model)), torch.float32)

    exported, beside, plain = base(), base(), base()
    load_trained_weights(exported, merged)  # generate.py --checkpoint_path <export>
    load_trained_weights(beside, unmerged)
    setup_trainable(beside, use_lora=True, pretrained_lora_path=str(unmerged / "lora"))
    merge_adapter(plain, ckpt / "lora")  # W + BA: the unquantized base with the adapter
    settings = SamplerSettings(sde_type="sage_grpo", eta=0.5, num_steps=4, shift=3.0, cfg_scale=1.0)
    original, latents = tiny_pipe.transformer, {}
    try:
        for name, model in (("policy", policy), ("export", exported), ("beside", beside), ("plain", plain)):
            tiny_pipe.transformer = model.eval()
            latents[name] = _run(tiny_pipe, text_cache, settings).latents[:, -1]
    finally:
        tiny_pipe.transformer = original
    err = {name: _rel(latents[name], latents["policy"]) for name in ("export", "beside", "plain")}
    assert err["export"] < 1e-5 and err["beside"] < 1e-5, err  # fp32 rounding of x (Q(W) + BA) against x Q(W) + x BA
    assert err["plain"] > max(1e-4, 1e3 * err["export"], 1e3 * err["beside"]), err  # the base's quantization error
    print(f"FP8 run's rollout against its exports: {err}")


@pytest.mark.parametrize("argv,world,message", [
    (["--fp8_base"], 1, "--fp8_base quantizes the frozen base of a LoRA run; add --use_lora"),
    (["--use_lora", "--fp8_matmul"], 1, "--fp8_matmul runs the layers of an FP8 base; add --fp8_base"),
    (["--use_lora", "--fp8_base", "--fp8_matmul", "--dtype", "fp32"], 1, "--fp8_matmul computes in bf16.*--dtype bf16"),
])
def test_fp8_refusals(argv, world, message):
    cfg = load_config([*argv, "--train_video_csv", "prompts.csv"])
    with pytest.raises(SageGRPOError, match=message):
        validate(cfg, world)
    for fsdp in ("True", "False"):  # FSDP2 shards the FP8 base; without it every rank holds it
        validate(load_config(["--use_lora", "--fp8_base", "--enable_fsdp", fsdp, "--train_video_csv", "p.csv"]), 2)


@pytest.mark.slow
def test_full_fine_tuning_with_fp8_base_is_one_line_and_exit_code_2(tiny_model, tmp_path):
    argv = _args(tiny_model, tmp_path / "run", "--fp8_base")
    r = subprocess.run([sys.executable, str(ROOT / "post_train.py"), *argv], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == ("error: --fp8_base quantizes the frozen base of a LoRA run; add --use_lora (full "
                                "fine-tuning trains every weight in --master_weight_type)")


def test_fp8_matmul_needs_an_fp8_gpu(tiny_model, tmp_path, monkeypatch):
    block = _blocks(torch.nn.Linear(32, 16))
    with pytest.raises(SageGRPOError, match="--fp8_matmul needs a CUDA GPU of compute capability 8.9"):
        quantize_base(block, "cpu", fp8_matmul=True)
    assert not is_quantized(block)

    def never(*a, **k):
        raise AssertionError("a model loaded before --fp8_matmul was checked")

    monkeypatch.setattr(pt, "setup", never)  # post_train's first model load
    with pytest.raises(SageGRPOError, match="--fp8_matmul needs a CUDA GPU of compute capability 8.9.*not the cpu"):
        pt.main(_args(tiny_model, tmp_path / "run", "--use_lora", "--fp8_base", "--fp8_matmul", "--dtype", "bf16"))

    from helpers import load_script

    import sage_grpo.models.loading as loading

    monkeypatch.setattr(loading, "load_pipeline", never)  # generate.py's first model load
    generate = load_script("generate.py")
    common = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--model_path", str(tiny_model), "--prompt", "a ball",
              "--output_path", str(tmp_path / "v.mp4"), "--dtype", "bf16"]
    with pytest.raises(SageGRPOError, match="--fp8_matmul runs the layers of an FP8 base; add --fp8_base"):
        generate.main([*common, "--fp8_matmul", "True"])
    with pytest.raises(SageGRPOError, match="--fp8_matmul needs a CUDA GPU of compute capability 8.9.*not the cpu"):
        generate.main([*common, "--fp8_base", "True", "--fp8_matmul", "True"])


@pytest.mark.slow
def test_the_24gb_recipe_fits_24_gib_by_the_plan_and_only_with_the_fp8_base():
    from helpers import load_script

    pm = load_script("plan_memory", register=True)
    argv = ["--config", str(ROOT / "configs/lora_24gb.yaml"), "--world_size", "1", "--gpu_memory_gib", "24",
            "--num_prompts", "1"]
    fp8 = pm.main([*argv, "--json"])
    assert fp8["setting"]["fp8_base"] and fp8["fits"] and max(fp8["phases_gib"].values()) <= 24, fp8["phases_gib"]
    bf16 = pm.main([*argv, "--fp8_base", "False", "--json"])
    assert not bf16["fits"]
    # the FP8 base: one byte per block-linear weight and a float32 scale per output row, the rest in bf16
    saved = bf16["terms_gib"]["policy weights"] - fp8["terms_gib"]["policy weights"]
    assert 7.5 < saved < 7.7, saved  # 8.15B block-linear weights: 2 bytes -> 1 (+ scales)


@pytest.mark.slow
def test_the_plan_of_a_sharded_fp8_base_shards_and_gathers_its_bytes():
    """Under FSDP2 on 8 GPUs the FP8 base saves on every rank an eighth of what it saves on one GPU, and each gather
    (two blocks in flight; the whole model per forward, 7/8 of it from the other ranks) moves FP8 bytes."""
    from helpers import load_script

    pm = load_script("plan_memory", register=True)
    one = ["--config", str(ROOT / "configs/lora_24gb.yaml"), "--num_prompts", "1", "--json"]
    saved_one = (pm.main([*one, "--world_size", "1", "--fp8_base", "False"])["terms_gib"]["policy weights"]
                 - pm.main([*one, "--world_size", "1"])["terms_gib"]["policy weights"])
    eight = [*one, "--world_size", "8", "--enable_fsdp", "True", "--batch_size", "1"]
    fp8, bf16 = pm.main(eight), pm.main([*eight, "--fp8_base", "False"])
    assert fp8["setting"]["fsdp"] and fp8["setting"]["shard_ranks"] == 8
    saved = {k: bf16["terms_gib"][k] - fp8["terms_gib"][k] for k in ("policy weights", "unsharded blocks (fwd)")}
    assert saved["policy weights"] == pytest.approx(saved_one / 8, rel=1e-9)
    assert saved["unsharded blocks (fwd)"] == pytest.approx(2 * saved_one / fp8["params"]["num_blocks"], rel=1e-9)
    gather = bf16["traffic"]["model_gather_gib"] - fp8["traffic"]["model_gather_gib"]
    assert gather == pytest.approx(7 / 8 * saved_one, rel=1e-9)


def test_gpu_check_caps_the_allocator_and_puts_its_lora_runs_on_the_fp8_base(tmp_path, monkeypatch, capsys):
    from helpers import load_script

    gpu_check = load_script("gpu_check", register=True)
    ck = gpu_check.Check(gpu_check.parse(["--out", str(tmp_path), "--tiny", "--memory_cap_gib", "24", "--fp8_base"]))
    assert ck.gpu_gib == 24 and ck.lora_flags[-2:] == ["--fp8_base", "True"]
    assert "no CUDA allocator on the CPU, nothing capped" in capsys.readouterr().out  # a no-op on the CPU
    set_to = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 96 * 2**30}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: set_to.append((f, i)))
    assert gpu_check.cap_allocator(24, "cuda") == 0.25 and set_to == [(0.25, 0)]
    with pytest.raises(SageGRPOError, match=r"--memory_cap_gib must be in \(0, 96.0\]"):
        gpu_check.cap_allocator(100, "cuda")


@pytest.mark.slow
def test_real_size_cpu_runs_its_miniature_on_the_fp8_base(tmp_path):
    work = tmp_path / "rs"
    p = subprocess.run([sys.executable, str(ROOT / "scripts/real_size_cpu.py"), "--miniature", "--fp8_base", "--work",
                        str(work), "--threads", "1", "--stages", "train,fsdp,planner"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((work / "real_size_cpu.json").read_text())
    assert res["settings"]["fp8_base"] and res["planner"]["setting"]["fp8_base"]
    assert res["train"]["policy_tensor_gib"] > 0 and "policy_resident_gib" in res["train"]
    # RSS counts the mapped file pages besides the anonymous memory
    assert res["train"]["policy_rss_gib"] >= res["train"]["policy_resident_gib"] - 0.05
    saved = json.loads((work / "run_a" / "checkpoint-2" / "train_state.json").read_text())
    assert saved["config"]["model"]["fp8_base"] is True
    # two FSDP2 ranks on the sharded FP8 base: their LoRA step is the one-process step on the FP8 base
    fsdp = res["fsdp"]
    assert "failed" not in fsdp and fsdp["adapter_max_abs"] > 0, fsdp
    assert fsdp["max_abs_diff_vs_one_process"] <= 1e-6 * fsdp["adapter_max_abs"], fsdp
    ranks = json.loads((work / "run_fsdp" / "checkpoint-1" / "train_state.json").read_text())
    assert ranks["config"]["model"]["fp8_base"] is True and ranks["config"]["parallel"]["enable_fsdp"] is True
