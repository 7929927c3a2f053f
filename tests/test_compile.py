"""Compiled transformer blocks (--compile, sage_grpo.models.compile) against the eager model."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import attention_inputs, max_rel, perturbed_transformer
from torch._dynamo.testing import CompileCounterWithBackend

from sage_grpo.config import load_config
from sage_grpo.models.attention import use_valid_token_attention
from sage_grpo.models.compile import blocks_compiled, compile_blocks, uncompile_blocks
from sage_grpo.models.tiny import tiny_transformer_config


def _run(model, inputs, weight, grad=True):
    """Output and parameter gradients of a weighted sum of it (no_grad: the output only)."""
    model.zero_grad(set_to_none=True)
    if not grad:
        with torch.no_grad():
            return model(**inputs)[0], None
    out = model(**inputs)[0]
    (out * weight).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _weight(inputs):
    cfg = tiny_transformer_config()
    return torch.randn(inputs["hidden_states"].shape[0], cfg["out_channels"], 3, 4, 6,
                       generator=torch.Generator().manual_seed(2))


# inductor's kernels once (50 s on 2 cores: C++ code generation of a forward and a backward graph); checkpointing's
# recomputation through the same compiled blocks with aot_eager (AOTAutograd's joint graph without code generation,
# ~10 s), which is where checkpointing and compilation meet
@pytest.mark.slow
@pytest.mark.parametrize(("checkpointing", "backend"), [(False, "inductor"), (True, "aot_eager")])
def test_compiled_blocks_equal_eager(checkpointing, backend, tmp_path, monkeypatch):
    # a private kernel cache: the shared /tmp/torchinductor_<user> can hold a half-written kernel of another process
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    eager = use_valid_token_attention(perturbed_transformer(torch.float32, layers=2))
    compiled = compile_blocks(copy.deepcopy(eager), backend=backend)
    if checkpointing:
        eager.enable_gradient_checkpointing()
        compiled.enable_gradient_checkpointing()
    inputs = attention_inputs(torch.float32)  # a CFG-like pair of different valid lengths
    w = _weight(inputs)
    out_e, g_e = _run(eager, inputs, w)
    out_c, g_c = _run(compiled, inputs, w)
    assert max_rel(out_c, out_e) < 1e-5
    # the last block's text-stream output is discarded, so eager autograd leaves its to_add_out / ff_context
    # gradients None; the compiled backward returns zeros for them (the module docstring says what that changes)
    assert g_e and set(g_e) <= set(g_c)
    unused = set(g_c) - set(g_e)
    assert all(k.startswith(f"transformer_blocks.{len(eager.transformer_blocks) - 1}.") for k in unused), unused
    assert all(float(g_c[k].abs().max()) == 0.0 for k in unused)
    # per parameter, relative to its largest gradient; attention key biases have an exactly-zero gradient (softmax
    # ignores a shift shared by every key), ~1e-10 of rounding noise in both runs: those are held to the floor
    floor = 1e-4 * max(float(g.abs().max()) for g in g_e.values())
    errors = {k: float((g_c[k] - g_e[k]).abs().max()) / max(float(g_e[k].abs().max()), floor) for k in g_e}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, (worst, errors[worst])


@pytest.mark.slow
def test_blocks_share_graphs_and_recompilations_are_bounded_across_text_lengths():
    """Eight prompt-length pairs, batch 2 and 1, no_grad (rollout) and grad (update): the count of compiled graphs
    stays at the few that grad mode, batch 1 and the order of the lengths in a pair need, whatever the lengths and the
    depth."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    model = compile_blocks(use_valid_token_attention(perturbed_transformer(torch.float32, layers=3)), backend=counter)
    reference = use_valid_token_attention(perturbed_transformer(torch.float32, layers=3))
    lengths = [(17, 3), (12, 5), (20, 20), (9, 2), (24, 1), (12, 16), (16, 8), (2, 23)]  # (12, 16): equal
    seen = []
    for batch in (2, 1):
        for grad in (False, True):
            for txt in lengths:
                inputs = attention_inputs(torch.float32, txt_valid=txt[:batch], b5_valid=(5, 1)[:batch])
                w = _weight(inputs)
                out, _ = _run(model, inputs, w, grad)
                ref, _ = _run(reference, inputs, w, grad)
                assert max_rel(out, ref) < 1e-6
            seen.append(counter.frame_count)
    # no_grad / grad x (a batch of 1, and a pair whose first or second sample is longer or both equal: which samples
    # get zero padding and share an attention call); without dynamic shapes every new length would add graphs
    # (8 x 4 here), and without the blocks sharing one function every block would (x 3 here, x 54 for the real model)
    assert seen == [3, 6, 7, 8], seen
    again = counter.frame_count
    for txt in [(11, 4), (19, 7)]:
        _run(model, attention_inputs(torch.float32, txt_valid=txt), None, False)
    assert counter.frame_count == again  # lengths never seen: no new graph


def test_compiled_blocks_survive_deepcopy_and_uncompile():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    model = compile_blocks(use_valid_token_attention(perturbed_transformer(torch.float32, layers=2)), backend=counter)
    copied = copy.deepcopy(model)  # what the full-fine-tuning anchor is
    assert blocks_compiled(copied)
    for block in copied.transformer_blocks:
        assert block.forward.args[1] is block  # bound to its own copy, not to the original block
    with torch.no_grad():
        for p in copied.parameters():
            p.mul_(1.5)
    inputs = attention_inputs(torch.float32)
    out_m, _ = _run(model, inputs, None, False)
    out_c, _ = _run(copied, inputs, None, False)
    assert counter.frame_count >= 1
    assert max_rel(out_c, out_m) > 1e-2  # the copy runs its own weights
    uncompile_blocks(copied)
    assert not blocks_compiled(copied)
    frames = counter.frame_count
    out_u, _ = _run(copied, inputs, None, False)
    assert counter.frame_count == frames
    assert max_rel(out_u, out_c) < 1e-6


def test_compile_is_a_config_flag():
    assert load_config([]).model.compile is False
    assert load_config(["--compile"]).model.compile is True
    assert load_config(["--compile", "False"]).model.compile is False


def test_compile_with_fsdp2_or_ulysses_under_torchrun_is_one_clear_error():
    from sage_grpo.config import validate
    from sage_grpo.errors import SageGRPOError

    base = ["--train_video_csv", "p.txt", "--batch_size", "2", "--num_generations", "2"]
    validate(load_config([*base, "--compile"]), 1)  # one process: fine
    validate(load_config([*base, "--compile", "--enable_fsdp", "False"]), 2)  # replicated weights: fine
    with pytest.raises(SageGRPOError, match="--compile is not yet verified with FSDP2 under torchrun"):
        validate(load_config([*base, "--compile"]), 2)
    with pytest.raises(SageGRPOError, match="--compile is not yet verified with --sp_size 2"):
        validate(load_config([*base, "--compile", "--enable_fsdp", "False", "--sp_size", "2"]), 2)
