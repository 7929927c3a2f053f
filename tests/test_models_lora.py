"""sage_grpo/models/lora.py on a freshly built tiny HunyuanVideo-1.5 transformer: adapter injection with the requested
r / alpha / targets, the save/load round trip, the merged weights against W + (alpha / r) B A computed here, and
the adapter's parameters."""

from __future__ import annotations

import json

import pytest
import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.models.lora import (
    adapter_parameters,
    default_lora_targets,
    load_lora,
    lora_state_dict,
    merged_state_dict,
    save_lora,
    setup_trainable,
)


def _transformer(seed: int = 0):
    from diffusers import HunyuanVideo15Transformer3DModel

    from sage_grpo.models.tiny import tiny_transformer_config

    torch.manual_seed(seed)
    return HunyuanVideo15Transformer3DModel(**tiny_transformer_config()).eval()


def _randomize_adapter(tr, seed: int) -> None:
    """peft starts B at 0 (the adapter is a no-op); give every A and B values so that the checks below can fail."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(tr).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_adapter_is_injected_with_the_requested_settings():
    tr = _transformer()
    base_names = {n for n, _ in tr.named_parameters()}
    want = {n for n, m in tr.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith((".to_q", ".to_k"))}
    params = setup_trainable(tr, use_lora=True, lora_r=3, lora_alpha=12, lora_target_modules=["to_q", "to_k"])
    cfg = tr.peft_config["default"]
    assert (cfg.r, cfg.lora_alpha, set(cfg.target_modules)) == (3, 12, {"to_q", "to_k"})
    wrapped = {n.rsplit(".lora_A.", 1)[0] for n in adapter_parameters(tr) if ".lora_A." in n}
    assert wrapped == want and len(want) > 0  # every to_q / to_k linear, nothing else
    for name, p in adapter_parameters(tr).items():
        rows_or_cols = p.shape[0] if ".lora_A." in name else p.shape[1]
        assert rows_or_cols == 3, name  # A: [r, in], B: [out, r]
    trainable = {n for n, p in tr.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_parameters(tr)) and len(params) == len(trainable)
    assert not any(p.requires_grad for n, p in tr.named_parameters() if "lora_" not in n)
    assert base_names.isdisjoint(adapter_parameters(tr))


def test_default_targets_are_the_linears_of_the_blocks():
    tr = _transformer()
    targets = default_lora_targets(tr)
    linears = [n for n, m in tr.named_modules() if isinstance(m, torch.nn.Linear)]
    assert targets and set(targets) < set(linears)  # the embedders and the output projection stay plain
    assert all(n.startswith("transformer_blocks.") for n in targets)
    assert {n for n in linears if n.startswith("transformer_blocks.")} == set(targets)


def test_save_and_load_round_trip(tmp_path):
    src = _transformer()
    setup_trainable(src, use_lora=True, lora_r=2, lora_alpha=4, lora_target_modules=["to_q"])
    _randomize_adapter(src, seed=1)
    path = save_lora(src, tmp_path / "adapter")
    assert path.name == "adapter_model.safetensors"
    settings = json.loads((path.parent / "adapter_config.json").read_text())
    assert settings == {"r": 2, "lora_alpha": 4, "lora_dropout": 0.0, "target_modules": ["to_q"]}

    dst = _transformer()
    setup_trainable(dst, use_lora=True, lora_r=2, lora_alpha=4, lora_target_modules=["to_q"])
    before = {k: v.clone() for k, v in lora_state_dict(dst).items()}
    load_lora(dst, path.parent)
    got, want = lora_state_dict(dst), lora_state_dict(src)
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert any(not torch.equal(before[k], want[k]) for k in want)  # the load changed something

    wrong = _transformer()
    setup_trainable(wrong, use_lora=True, lora_r=2, lora_alpha=4, lora_target_modules=["to_k"])
    with pytest.raises(SageGRPOError, match="does not fit the model"):
        load_lora(wrong, path)


def test_merged_state_dict_is_base_plus_scaled_b_a():
    tr = _transformer()
    base = {k: v.clone() for k, v in tr.state_dict().items()}
    setup_trainable(tr, use_lora=True, lora_r=4, lora_alpha=6, lora_target_modules=["to_q", "to_v"])
    _randomize_adapter(tr, seed=2)
    merged = merged_state_dict(tr)
    assert set(merged) == set(base)  # the plain model's keys: no base_layer / lora_ entries
    lora = {n: p.detach() for n, p in adapter_parameters(tr).items()}
    changed = 0
    for key, w in base.items():
        module = key.rsplit(".", 1)[0]
        a = lora.get(f"{module}.lora_A.default.weight")
        if a is None or not key.endswith(".weight"):
            assert torch.equal(merged[key], w), key  # untouched: biases and every module without an adapter
            continue
        b = lora[f"{module}.lora_B.default.weight"]
        want = w.double() + (6 / 4) * (b.double() @ a.double())
        torch.testing.assert_close(merged[key].double(), want, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(merged[key], w)
        changed += 1
    assert changed == len([n for n in lora if ".lora_A." in n]) > 0


def test_without_adapters_the_merged_state_is_the_plain_state():
    tr = _transformer()
    setup_trainable(tr, use_lora=False)
    sd = tr.state_dict()
    merged = merged_state_dict(tr)
    assert set(merged) == set(sd) and all(merged[k] is sd[k] or torch.equal(merged[k], sd[k]) for k in sd)
    assert adapter_parameters(tr) == {}


def test_lora_policy_keeps_the_frozen_base_in_the_compute_dtype(tiny_model):
    """--use_lora with bf16 compute and fp32 master weights: the frozen base loads in bf16 (an fp32 copy of the real
    8.3B base is 33 GB of host memory) and only the adapters are fp32 (what the optimizer updates)."""
    from sage_grpo.config import load_config
    from sage_grpo.parallel.dist import DistInfo
    from tests.post_train_helpers import _args, pt

    cfg = load_config(_args(tiny_model, "unused", "--use_lora", "True", "--dtype", "bf16",
                            "--master_weight_type", "fp32"))
    from sage_grpo.models.loading import load_pipeline

    pipe = load_pipeline(model_path=str(tiny_model), dtype="bf16", load_text_encoders=False, load_transformer=False)
    transformer, trainable = pt.load_policy(cfg, DistInfo(), pipe)
    assert pipe.transformer is transformer
    dtypes = {n: p.dtype for n, p in transformer.named_parameters()}
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
