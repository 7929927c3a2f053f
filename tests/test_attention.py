"""Valid-token attention (sage_grpo.models.attention) against diffusers' own HunyuanVideo-1.5 processor."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import attention_inputs, max_rel, perturbed_transformer

from sage_grpo.errors import SageGRPOError
from sage_grpo.models.attention import (
    ValidTokenAttnProcessor,
    use_diffusers_attention,
    use_valid_token_attention,
    valid_lengths,
    valid_token_attention_enabled,
)
from sage_grpo.models.tiny import tiny_transformer_config


def _run(model, inputs, weight):
    """Output and the gradients (parameters by name, and the latent input) of a weighted sum of it."""
    model.zero_grad(set_to_none=True)
    x = inputs["hidden_states"].clone().requires_grad_(True)
    out = model(**{**inputs, "hidden_states": x})[0]
    (out.double() * weight).sum().backward()
    grads = {n: p.grad.double() if p.grad is not None else torch.zeros_like(p, dtype=torch.float64)
             for n, p in model.named_parameters() if p.requires_grad}
    return out.detach().double(), grads, x.grad.double()


def _compare(dtype, tol_out, tol_grad, checkpointing=False, **kw):
    stock = perturbed_transformer(dtype)
    ours = use_valid_token_attention(copy.deepcopy(stock))
    if checkpointing:
        stock.enable_gradient_checkpointing()
        ours.enable_gradient_checkpointing()
    inputs = attention_inputs(dtype, **kw)
    w = torch.randn(inputs["hidden_states"].shape[0], tiny_transformer_config()["out_channels"], 3, 4, 6,
                    generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out_s, g_s, gx_s = _run(stock, inputs, w)
    out_o, g_o, gx_o = _run(ours, inputs, w)
    assert torch.isfinite(out_o).all()
    assert (out_o - out_s).abs().max() <= tol_out * out_s.abs().max(), float((out_o - out_s).abs().max())
    assert max_rel(gx_o, gx_s) <= tol_grad
    worst = max(g_s, key=lambda n: float((g_o[n] - g_s[n]).abs().max()))
    g_max = max(float(g.abs().max()) for g in g_s.values())
    assert float((g_o[worst] - g_s[worst]).abs().max()) <= tol_grad * g_max, worst
    return stock, ours


def test_fp64_equals_diffusers_processor_cfg_batch_of_different_lengths():
    _compare(torch.float64, 1e-12, 1e-11)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fp32_outputs_and_gradients_match(checkpointing):
    _compare(torch.float32, 1e-5, 1e-5, checkpointing=checkpointing)


@pytest.mark.parametrize("kw", [dict(txt_valid=(9, 9), b5_valid=(2, 2)), dict(txt_valid=(24, 5, 5), b5_valid=(8, 0, 0)),
                                dict(image=True), dict(txt_valid=(12,), b5_valid=(0,))])
def test_other_batches(kw):
    """Equal lengths (one call), full-length and empty ByT5 prompts, runs of equal lengths, i2v image tokens,
    batch 1."""
    _compare(torch.float32, 1e-5, 1e-5, **kw)


def test_bf16_to_bf16_rounding():
    """bf16: ours is as close to the fp64 result as diffusers' processor is (and to a few bf16 ulps of it)."""
    ref = perturbed_transformer(torch.float64)
    inputs64 = attention_inputs(torch.float64)
    inputs16 = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in inputs64.items()}
    with torch.no_grad():
        exact = ref(**inputs64)[0]
        stock = copy.deepcopy(ref).to(torch.bfloat16)
        out_s = stock(**inputs16)[0].double()
        out_o = use_valid_token_attention(stock)(**inputs16)[0].double()
    scale = exact.abs().max()
    err_s, err_o = (out_s - exact).abs().max() / scale, (out_o - exact).abs().max() / scale
    assert err_o <= 1.5 * err_s + 2**-8, (err_o, err_s)
    assert (out_o - out_s).abs().max() / scale <= 2**-5  # a few bf16 ulps of the largest value


def test_lora_adapters_train_through_the_processor():
    from sage_grpo.models.lora import setup_trainable

    stock = perturbed_transformer(torch.float32)
    setup_trainable(stock, use_lora=True, lora_r=4, lora_alpha=8)
    with torch.no_grad():  # lora_B starts at zero: make the adapters change the output
        for n, p in stock.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ours = use_valid_token_attention(copy.deepcopy(stock))
    assert type(ours.transformer_blocks[0].attn.to_q).__module__.startswith("peft")
    inputs = attention_inputs(torch.float32)
    w = torch.randn(2, 4, 3, 4, 6, dtype=torch.float64)
    out_s, g_s, _ = _run(stock, inputs, w)
    out_o, g_o, _ = _run(ours, inputs, w)
    assert g_s and all("lora_" in n for n in g_s)
    assert max_rel(out_o, out_s) <= 1e-5
    for n in g_s:
        assert (g_o[n] - g_s[n]).abs().max() <= 1e-5 * max(float(g.abs().max()) for g in g_s.values()), n


def test_switching_is_idempotent_and_survives_deepcopy():
    stock = perturbed_transformer(torch.float64, layers=1)
    m = copy.deepcopy(stock)
    use_valid_token_attention(m)
    use_valid_token_attention(m)
    block = m.transformer_blocks[0]
    assert len(block._forward_pre_hooks) == 1 and valid_token_attention_enabled(m)
    assert not isinstance(m.context_embedder.token_refiner.refiner_blocks[0].attn.processor, ValidTokenAttnProcessor)
    twin = copy.deepcopy(m)
    assert valid_token_attention_enabled(twin)
    inputs = attention_inputs(torch.float64)
    with torch.no_grad():
        ref = stock(**inputs)[0]
        torch.testing.assert_close(twin(**inputs)[0], ref, rtol=0, atol=1e-12)
        use_diffusers_attention(m)  # the padding-cut hook must then do nothing
        assert not valid_token_attention_enabled(m)
        torch.testing.assert_close(m(**inputs)[0], ref, rtol=0, atol=0)


def test_a_valid_token_processor_is_kept():
    """A processor that already attends over valid tokens (the sequence-parallel subclass, whose hooks sit outside
    the blocks) survives a second switch, as load_pipeline makes it on a transformer parallelised before."""

    class Subclass(ValidTokenAttnProcessor):
        pass

    m = use_valid_token_attention(perturbed_transformer(torch.float64, layers=1))
    proc = Subclass()
    m.transformer_blocks[0].attn.set_processor(proc)
    use_valid_token_attention(m)
    assert m.transformer_blocks[0].attn.processor is proc


def test_valid_lengths_cached_and_checked():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert valid_lengths(mask, 2, 4) == (3, 1)
    assert valid_lengths(mask, 2, 2) == (2, 1)  # capped by the (cut) token count
    assert valid_lengths(None, 3, 5) == (5, 5, 5)
    with pytest.raises(SageGRPOError, match="valid encoder tokens first"):
        valid_lengths(torch.tensor([[1, 0, 1]], dtype=torch.bool), 1, 3)


def test_not_a_hunyuan_transformer():
    with pytest.raises(SageGRPOError, match="HunyuanVideo15Transformer3DModel"):
        use_valid_token_attention(torch.nn.Linear(2, 2))


def test_load_pipeline_makes_it_the_default(tiny_pipe):
    assert valid_token_attention_enabled(tiny_pipe.transformer)


# ------------------------------------------------------------------------------------------------ --attention_backend


def _cpu_backends(training=True):
    from sage_grpo.models.attention import ATTENTION_BACKENDS, probe_attention_backend

    return [b for b in ATTENTION_BACKENDS[1:] if not b.endswith("_hub")
            and probe_attention_backend(b, "cpu", torch.float32, training) is None]


def test_every_backend_that_runs_on_the_cpu_gives_natives_outputs_and_gradients():
    from sage_grpo.models.attention import attention_backend_of, set_attention_backend

    backends = _cpu_backends()
    assert {"native", "_native_math", "_native_flash"} <= set(backends)  # torch's SDPA kernels of the CPU
    inputs = attention_inputs(torch.float32)
    w = torch.randn(2, tiny_transformer_config()["out_channels"], 3, 4, 6, generator=torch.Generator().manual_seed(2),
                    dtype=torch.float64)
    model = use_valid_token_attention(perturbed_transformer(torch.float32))
    out_n, g_n, gx_n = _run(set_attention_backend(model, "native"), inputs, w)
    for name in backends:
        out, g, gx = _run(set_attention_backend(model, name), inputs, w)
        assert attention_backend_of(model) == name
        assert (out - out_n).abs().max() <= 1e-5 * out_n.abs().max(), name
        assert max_rel(gx, gx_n) <= 1e-5, name
        g_max = max(float(x.abs().max()) for x in g_n.values())
        assert max(float((g[k] - g_n[k]).abs().max()) for k in g_n) <= 1e-5 * g_max, name


def test_a_backend_that_runs_only_forward_on_the_cpu_gives_natives_outputs():
    """flex runs a forward on the CPU in fp32 (no backward there): generation can use it, with native's outputs."""
    from sage_grpo.models.attention import set_attention_backend

    forward_only = [b for b in _cpu_backends(training=False) if b not in _cpu_backends()]
    assert "flex" in forward_only
    inputs = attention_inputs(torch.float32)
    model = use_valid_token_attention(perturbed_transformer(torch.float32))
    with torch.no_grad():
        ref = model(**inputs)[0]
        for name in forward_only:
            out = set_attention_backend(model, name)(**inputs)[0]
            assert (out - ref).abs().max() <= 1e-5 * ref.abs().max(), name


def test_the_backend_reaches_every_processor_and_survives_switching_and_sequence_parallelism():
    from sage_grpo.models.attention import attention_backend_of, set_attention_backend
    from sage_grpo.models.sequence_parallel import UlyssesAttnProcessor

    model = use_valid_token_attention(perturbed_transformer(torch.float32))
    assert attention_backend_of(model) == "auto"  # today's default: the dispatcher's active backend
    set_attention_backend(model, "_native_math")
    use_diffusers_attention(model)
    use_valid_token_attention(model)
    assert attention_backend_of(model) == "_native_math"
    for block in model.transformer_blocks:  # what enable_sequence_parallel installs
        block.attn.set_processor(UlyssesAttnProcessor(state=None))
    set_attention_backend(model, "native")
    assert {b.attn.processor._attention_backend.value for b in model.transformer_blocks} == {"native"}
    assert set_attention_backend(model, "auto") and attention_backend_of(model) == "auto"


def test_a_backend_without_backward_is_refused_for_training_only(monkeypatch):
    """SageAttention's kernels have no backward: the probe runs one, so training refuses what generation takes."""
    from diffusers.models import attention_dispatch

    from sage_grpo.models.attention import check_attention_backend, probe_attention_backend

    monkeypatch.setattr(attention_dispatch, "dispatch_attention_fn", lambda q, k, v, backend: q.detach() * 2)
    assert probe_attention_backend("native", "cpu", torch.float32, training=False) is None
    assert probe_attention_backend("native", "cpu", torch.float32, training=True) == (
        "has no backward (inference only: generate.py)")
    with pytest.raises(SageGRPOError, match=r"--attention_backend native cannot run training here: has no backward"):
        check_attention_backend("native", "cpu", torch.float32, training=True)


@pytest.mark.slow
def test_a_backend_this_machine_lacks_is_one_line_before_any_model_loads(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    missing = tmp_path / "no_model"  # a model that is not there: the backend is refused before anything loads it
    p = subprocess.run([sys.executable, str(root / "post_train.py"), "--config", str(root / "configs/tiny_cpu.yaml"),
                        "--model_path", str(missing), "--output_dir", str(tmp_path / "run"), "--report_to", "none",
                        "--train_video_csv", str(root / "configs/tiny_prompts.txt"), "--attention_backend", "flash"],
                       capture_output=True, text=True, cwd=root, timeout=300, env={**__import__("os").environ,
                                                                                   "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("error: --attention_backend flash cannot run training here: not installed (")
    assert lines[0].endswith("this machine runs: auto, " + ", ".join(_cpu_backends()))
    assert not (tmp_path / "run").exists()
