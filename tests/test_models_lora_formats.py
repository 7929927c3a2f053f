"""sage_grpo/models/lora_formats.py: the fused q,k,v and modulation-order rules of a LoRA against matrix products
computed here, the diffusers -> original -> diffusers round trip, merging an original-keyed LoRA into the authors'-
layout weights against peft's own merge converted by the weight converter, every file layout written and loaded
back, and the comfy keys against ComfyUI's key map rule."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from sage_grpo.errors import SageGRPOError
from sage_grpo.models import lora_formats as lf
from sage_grpo.models.convert import diffusers_to_authors_transformer
from sage_grpo.models.lora import adapter_parameters, lora_state_dict, merged_state_dict, setup_trainable

REFINER_QKV = "txt_in.individual_token_refiner.blocks.0.self_attn_qkv"
FINAL_MOD = "final_layer.adaLN_modulation.1"


def _transformer(seed: int = 0):
    from diffusers import HunyuanVideo15Transformer3DModel

    from sage_grpo.models.tiny import tiny_transformer_config

    torch.manual_seed(seed)
    return HunyuanVideo15Transformer3DModel(**tiny_transformer_config()).eval()


def _all_targets(tr) -> list[str]:
    """Every linear of the model: the blocks (renames), the refiner's q/k/v (fused in the authors' layout) and the
    final modulation (shift/scale swapped) included."""
    return [n for n, m in tr.named_modules() if isinstance(m, torch.nn.Linear)]


def _with_adapter(seed: int = 1, r: int = 2, alpha: int = 6):
    tr = _transformer()
    setup_trainable(tr, use_lora=True, lora_r=r, lora_alpha=alpha, lora_target_modules=_all_targets(tr))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # peft starts B at 0 (a no-op adapter): random A and B so the checks can fail
        for p in adapter_parameters(tr).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return tr


def _lora_of(tr) -> lf.Lora:
    cfg = tr.peft_config["default"]
    return lf.from_peft(lora_state_dict(tr), {"r": cfg.r, "lora_alpha": cfg.lora_alpha})


def _peft_merged(tr) -> dict[str, torch.Tensor]:
    """peft's own merge (BaseTunerLayer.merge), under the plain model's keys: the reference, none of our code."""
    import copy

    from peft.tuners.tuners_utils import BaseTunerLayer

    tr = copy.deepcopy(tr)
    for m in tr.modules():
        if isinstance(m, BaseTunerLayer):
            m.merge()
    return {k.replace(".base_layer.", "."): v for k, v in tr.state_dict().items() if "lora_" not in k}


# --------------------------------------------------------------------------------------------- q,k,v and swap


def _delta(a, b, alpha):
    return (alpha / a.shape[0]) * (b.double() @ a.double())


def test_fused_qkv_lora_is_the_three_split_loras_stacked():
    g = torch.Generator().manual_seed(0)
    d_in, d = 5, 4
    parts = {p: (torch.randn(r, d_in, generator=g), torch.randn(d, r, generator=g), al)
             for p, r, al in (("q", 2, 4.0), ("k", 3, 6.0), ("v", 2, 4.0))}  # scales 2, 2, 2; ranks differ
    fused = lf.diffusers_to_authors_lora({f"context_embedder.token_refiner.refiner_blocks.0.attn.to_{p}": v
                                          for p, v in parts.items()})
    a, b, alpha = fused[REFINER_QKV]
    assert a.shape == (7, d_in) and b.shape == (3 * d, 7) and alpha == 14.0  # rank r_q + r_k + r_v, same scale
    want = torch.cat([_delta(*parts[p]) for p in "qkv"], dim=0)
    torch.testing.assert_close(_delta(a, b, alpha), want, rtol=0, atol=1e-12)

    # different scales per part, and a projection without adapter (its rows stay 0)
    parts["k"] = (parts["k"][0], parts["k"][1], 1.5)
    del parts["v"]
    fused = lf.diffusers_to_authors_lora({f"context_embedder.token_refiner.refiner_blocks.0.attn.to_{p}": v
                                          for p, v in parts.items()})
    want = torch.cat([_delta(*parts["q"]), _delta(*parts["k"]), torch.zeros(d, d_in, dtype=torch.float64)])
    torch.testing.assert_close(_delta(*fused[REFINER_QKV]), want, rtol=1e-6, atol=1e-6)


def test_a_general_fused_lora_splits_exactly():
    """A fused q,k,v LoRA trained on the authors' model (B not block diagonal) -> three LoRAs sharing A."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 5, generator=g), torch.randn(12, 3, generator=g)
    split = lf.authors_to_diffusers_lora({REFINER_QKV: (a, b, 6.0)})
    got = torch.cat([_delta(*split[f"context_embedder.token_refiner.refiner_blocks.0.attn.to_{p}"]) for p in "qkv"])
    torch.testing.assert_close(got, _delta(a, b, 6.0), rtol=0, atol=1e-12)


def test_final_modulation_lora_rows_follow_the_shift_scale_swap():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 3, generator=g), torch.randn(8, 2, generator=g)
    [(name, (a2, b2, al))] = lf.diffusers_to_authors_lora({"norm_out.linear": (a, b, 2.0)}).items()
    assert name == FINAL_MOD and al == 2.0 and torch.equal(a2, a)
    # diffusers' rows are (scale, shift); the authors' (shift, scale): row i of one is row (i + 4) % 8 of the other
    assert torch.equal(b2, b[[4, 5, 6, 7, 0, 1, 2, 3]])


# ---------------------------------------------------------------------------------------------- whole model


def test_diffusers_to_original_and_back_is_identical():
    lora = _lora_of(_with_adapter())
    authors = lf.diffusers_to_authors_lora(lora)
    assert REFINER_QKV in authors and FINAL_MOD in authors and "double_blocks.0.img_attn_q" in authors
    back = lf.authors_to_diffusers_lora(authors)
    assert back.keys() == lora.keys()
    for m, (a, b, alpha) in lora.items():
        a2, b2, alpha2 = back[m]
        assert torch.equal(a2, a) and torch.equal(b2, b) and alpha2 == alpha, m


def test_original_lora_merged_into_authors_weights_equals_converted_diffusers_merge():
    tr = _with_adapter()
    base = {k.replace(".base_layer.", "."): v for k, v in tr.state_dict().items() if "lora_" not in k}
    want = diffusers_to_authors_transformer(_peft_merged(tr))
    got = lf.merge_into(diffusers_to_authors_transformer(base), lf.diffusers_to_authors_lora(_lora_of(tr)))
    assert got.keys() == want.keys()
    changed = set()
    for k in want:
        torch.testing.assert_close(got[k].float(), want[k].float(), rtol=1e-5, atol=1e-6, msg=k)
        if not torch.equal(want[k], diffusers_to_authors_transformer(base)[k]):
            changed.add(k)
    assert {f"{REFINER_QKV}.weight", f"{FINAL_MOD}.weight", "double_blocks.0.img_attn_v.weight"} <= changed


@pytest.mark.parametrize("fmt", lf.FORMATS)
def test_each_format_is_written_and_loaded_back(fmt, tmp_path):
    src = _with_adapter(alpha=5)
    path = lf.write_lora(_lora_of(src), tmp_path / fmt, fmt)
    assert path.name == lf.FILE_NAMES[fmt]
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
    assert lf.detect_format(keys) == fmt  # from the keys alone, without our metadata tag
    # the loader takes r / alpha / targets from the file (or its adapter_config.json), not these flags
    dst = _transformer()
    setup_trainable(dst, use_lora=True, lora_r=1, lora_alpha=1, lora_target_modules=["to_q"],
                    pretrained_lora_path=str(path.parent))
    got, want = lora_state_dict(dst), lora_state_dict(src)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    merged, ref = merged_state_dict(dst), _peft_merged(src)
    assert all(torch.allclose(merged[k], ref[k], rtol=1e-6, atol=1e-7) for k in ref)


def test_key_layouts_of_the_files(tmp_path):
    lora = _lora_of(_with_adapter())
    comfy = lf.write_lora(lora, tmp_path / "c", "comfy")
    with safe_open(str(comfy), framework="pt") as f:
        keys = set(f.keys())
        alpha = f.get_tensor(f"diffusion_model.{REFINER_QKV}.alpha")
    assert "diffusion_model.double_blocks.0.img_attn_q.lora_down.weight" in keys
    assert "diffusion_model.double_blocks.0.img_attn_q.lora_up.weight" in keys
    assert float(alpha) == 6 * 3  # fused rank 3 * 2, scale 6 / 2 kept
    orig = lf.write_lora(lora, tmp_path / "o", "original")
    with safe_open(str(orig), framework="pt") as f:
        assert "double_blocks.0.txt_mlp.fc1.lora_A.weight" in set(f.keys())
    diff = lf.write_lora(lora, tmp_path / "d", "diffusers")
    with safe_open(str(diff), framework="pt") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
        assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in set(f.keys())
    assert meta["transformer.r"] == 2 and meta["transformer.lora_alpha"] == 6
    cfg = json.loads((lf.write_lora(lora, tmp_path / "p", "peft").parent / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 2 and cfg["lora_alpha"] == 6


def test_diffusers_file_loads_with_diffusers_load_lora_adapter(tmp_path):
    src = _with_adapter()
    path = lf.write_lora(_lora_of(src), tmp_path, "diffusers")
    dst = _transformer()
    dst.load_lora_adapter(str(tmp_path), weight_name=path.name, adapter_name="x")  # diffusers' own loader
    got = _peft_merged(dst)
    ref = _peft_merged(src)
    assert all(torch.allclose(got[k], ref[k], rtol=1e-6, atol=1e-7) for k in ref)


def test_peft_directory_loads_with_peft_from_pretrained(tmp_path):
    from peft import PeftModel

    src = _with_adapter()
    lf.write_lora(_lora_of(src), tmp_path, "peft")
    model = PeftModel.from_pretrained(_transformer(), str(tmp_path))  # peft's own loader
    got = {k: v for k, v in model.merge_and_unload().state_dict().items()}
    ref = _peft_merged(src)
    assert all(torch.allclose(got[k], ref[k], rtol=1e-6, atol=1e-7) for k in ref)


def test_comfy_keys_are_in_comfyui_key_map():
    """ComfyUI (0.3.64, comfy/supported_models.py HunyuanVideo.process_unet_state_dict renames the original keys to
    its modules; comfy/lora.py model_lora_keys_unet maps `diffusion_model.<original name>` back by the inverse
    replacements). The rule is restated here from that source; every LoRA module of the transformer blocks, the
    refiner attention and the final layer must land on a weight."""
    authors = diffusers_to_authors_transformer(_transformer().state_dict())

    def comfy_internal(k: str) -> str:  # process_unet_state_dict
        k = k.replace("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer.").replace(
            "txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer.")
        k = k.replace("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer.").replace(
            "txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer.")
        k = k.replace("_mod.linear.", "_mod.lin.").replace("_attn_qkv.", "_attn.qkv.")
        k = k.replace("mlp.fc1.", "mlp.0.").replace("mlp.fc2.", "mlp.2.")
        k = k.replace("_attn_q_norm.weight", "_attn.norm.query_norm.scale").replace(
            "_attn_k_norm.weight", "_attn.norm.key_norm.scale")
        k = k.replace("_attn_proj.", "_attn.proj.").replace(".modulation.linear.", ".modulation.lin.")
        return "diffusion_model." + k.replace("_in.mlp.2.", "_in.out_layer.").replace("_in.mlp.0.", "_in.in_layer.")

    key_map = {}
    for k in map(comfy_internal, authors):  # model_lora_keys_unet: generic + HunyuanVideo branch
        if k.endswith(".weight"):
            key_map[k[: -len(".weight")]] = k
            lk = k.replace("_mod.lin.", "_mod.linear.").replace("_attn.qkv.", "_attn_qkv.").replace(
                "_attn.proj.", "_attn_proj.")
            lk = lk.replace("mlp.0.", "mlp.fc1.").replace("mlp.2.", "mlp.fc2.")
            lk = lk.replace(".modulation.lin.", ".modulation.linear.")
            key_map["diffusion_model." + lk[len("diffusion_model."): -len(".weight")]] = k
    tr = _with_adapter()
    modules = lf.diffusers_to_authors_lora(_lora_of(tr))
    wanted = [m for m in modules if m.startswith(("double_blocks.", "final_layer.")) or "refiner" in m]
    assert REFINER_QKV in wanted and "double_blocks.0.img_attn_q" in wanted
    missing = [m for m in wanted if "diffusion_model." + m not in key_map]
    assert not missing


def test_errors_are_one_clear_line():
    with pytest.raises(SageGRPOError, match="not HunyuanVideo-1.5 transformer modules: unet.down"):
        lf.diffusers_to_authors_lora({"unet.down": (torch.zeros(1, 2), torch.zeros(2, 1), 1.0)})
    with pytest.raises(SageGRPOError, match="not LoRA lora_A.weight/lora_B.weight pairs"):
        lf.from_peft({"a.lora_A.weight": torch.zeros(1, 2)}, {"r": 1, "lora_alpha": 1})
    with pytest.raises(SageGRPOError, match="--lora_format 'kohya' is not one of peft, diffusers, original, comfy"):
        lf.write_lora({}, "/nonexistent", "kohya")
