"""sage_grpo/models/lora_formats.py: the fused q,k,v and modulation-order rules of a LoRA against matrix products
computed here, the diffusers -> original -> diffusers round trip, merging an original-keyed LoRA into the authors'-
layout weights against peft's own merge converted by the weight converter, every file layout written and loaded
back, and the comfy export against ComfyUI's own key map, loader and merge (restated from its source)."""

from __future__ import annotations

import json
import re

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
        alpha = f.get_tensor("diffusion_model.txt_in.individual_token_refiner.blocks.0.self_attn.qkv.alpha")
        up = f.get_tensor("diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight")
    assert "diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight" in keys
    assert "diffusion_model.double_blocks.0.img_mlp.0.lora_up.weight" in keys
    assert not any("img_attn_q" in k for k in keys)
    assert float(alpha) == 6 * 3 and up.shape == (3 * 64, 3 * 2)  # fused rank 3 * 2, scale 6 / 2 kept
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


# ------------------------------------------------------------------------------------------------- ComfyUI
# ComfyUI's rules, restated here from its source (none of our code): Comfy-Org/ComfyUI comfy/lora.py ec93dcac,
# comfy/weight_adapter/lora.py 6f98b150, comfy/supported_models.py e3c35527, comfy/lora_convert.py 2bffe2f4; the
# HunyuanVideo model's modules from comfy/ldm/hunyuan_video/model.py (yzkee/ComfyUI 8d534945) and
# comfy/ldm/flux/layers.py (hiddenswitch/pip-and-uv-installable-ComfyUI 5c6c95ea).


def _comfyui_linears(n_double: int, n_refiner: int) -> set[str]:
    """The weight keys of the linears (and the img_in conv) of ComfyUI's HunyuanVideo-1.5 model, from its module
    tree: HunyuanVideo(img_in=PatchEmbed.proj, time_in=MLPEmbedder(in_layer, out_layer), txt_in=TokenRefiner(
    input_embedder, t_embedder/c_embedder=MLPEmbedder, individual_token_refiner.blocks[j](self_attn=SelfAttentionRef(
    qkv, proj), mlp=Sequential(0, SiLU, 2), adaLN_modulation=Sequential(SiLU, 1))), double_blocks[i]=Flux
    DoubleStreamBlock({img,txt}_mod=Modulation(lin), {img,txt}_attn=SelfAttention(qkv, norm, proj), {img,txt}_mlp=
    Sequential(0, GELU, 2)), byt5_in=ByT5Mapper(fc1, fc2, fc3), vision_in=wan MLPProj(proj=Sequential(LayerNorm, 1,
    GELU, 3, LayerNorm)), final_layer=LastLayer(linear, adaLN_modulation.1))."""
    keys = ["img_in.proj", "time_in.in_layer", "time_in.out_layer", "txt_in.input_embedder",
            "txt_in.t_embedder.in_layer", "txt_in.t_embedder.out_layer", "txt_in.c_embedder.in_layer",
            "txt_in.c_embedder.out_layer", "byt5_in.fc1", "byt5_in.fc2", "byt5_in.fc3", "vision_in.proj.1",
            "vision_in.proj.3", "final_layer.linear", "final_layer.adaLN_modulation.1"]
    for j in range(n_refiner):
        keys += [f"txt_in.individual_token_refiner.blocks.{j}.{m}"
                 for m in ("self_attn.qkv", "self_attn.proj", "mlp.0", "mlp.2", "adaLN_modulation.1")]
    for i in range(n_double):
        keys += [f"double_blocks.{i}.{s}_{m}" for s in ("img", "txt")
                 for m in ("mod.lin", "attn.qkv", "attn.proj", "mlp.0", "mlp.2")]
    return {f"diffusion_model.{k}.weight" for k in keys}


def _comfyui_process_unet_state_dict(sd: dict) -> dict:
    """supported_models.py HunyuanVideo.process_unet_state_dict (HunyuanVideo15 inherits it), plus the
    `diffusion_model.` prefix the model patcher's state dict has."""
    out = {}
    for k in sd:
        key_out = k
        key_out = key_out.replace("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer.").replace(
            "txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer.")
        key_out = key_out.replace("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer.").replace(
            "txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer.")
        key_out = key_out.replace("_mod.linear.", "_mod.lin.").replace("_attn_qkv.", "_attn.qkv.")
        key_out = key_out.replace("mlp.fc1.", "mlp.0.").replace("mlp.fc2.", "mlp.2.")
        key_out = key_out.replace("_attn_q_norm.weight", "_attn.norm.query_norm.weight").replace(
            "_attn_k_norm.weight", "_attn.norm.key_norm.weight")
        key_out = key_out.replace(".q_norm.weight", ".norm.query_norm.weight").replace(
            ".k_norm.weight", ".norm.key_norm.weight")
        key_out = key_out.replace("_attn_proj.", "_attn.proj.")
        key_out = key_out.replace(".modulation.linear.", ".modulation.lin.")
        key_out = key_out.replace("_in.mlp.2.", "_in.out_layer.").replace("_in.mlp.0.", "_in.in_layer.")
        if key_out.endswith(".scale"):
            key_out = "{}.weight".format(key_out[: -len(".scale")])
        out["diffusion_model." + key_out] = sd[k]
    return out


def _comfyui_key_map(sdk) -> dict[str, str]:
    """lora.py model_lora_keys_unet for a HunyuanVideo model (HunyuanVideo15 subclasses it in model_base.py):
    the generic rules, then the HunyuanVideo branch (unet_to_diffusers gives nothing: no num_res_blocks)."""
    key_map = {}
    for k in sdk:
        if k.startswith("diffusion_model."):
            if k.endswith(".weight"):
                key_lora = k[len("diffusion_model."): -len(".weight")].replace(".", "_")
                key_map[f"lora_unet_{key_lora}"] = k
                key_map["{}".format(k[: -len(".weight")])] = k  # generic lora format
            else:
                key_map[f"{k}"] = k
    for k in sdk:  # isinstance(model, comfy.model_base.HunyuanVideo)
        if k.startswith("diffusion_model.") and k.endswith(".weight"):
            key_lora = k
            key_lora = key_lora.replace("_mod.lin.", "_mod.linear.").replace("_attn.qkv.", "_attn_qkv.").replace(
                "_attn.proj.", "_attn_proj.")
            key_lora = key_lora.replace("mlp.0.", "mlp.fc1.").replace("mlp.2.", "mlp.fc2.")
            key_lora = key_lora.replace(".modulation.lin.", ".modulation.linear.")
            key_lora = key_lora[len("diffusion_model."): -len(".weight")]
            key_map[f"transformer.{key_lora}"] = k
            key_map[f"diffusion_model.{key_lora}"] = k
    return key_map


def _comfyui_load_lora(lora: dict, key_map: dict) -> tuple[dict, list[str]]:
    """lora.py load_lora with weight_adapter/lora.py LoRAAdapter.load (the lora_up/lora_down branch) ->
    ({model key: (up, down, alpha)}, the keys ComfyUI would log as "lora key not loaded")."""
    patches, loaded = {}, set()
    for x in key_map:
        alpha = None
        if f"{x}.alpha" in lora:
            alpha = lora[f"{x}.alpha"].item()
            loaded.add(f"{x}.alpha")
        if f"{x}.lora_up.weight" in lora:
            patches[key_map[x]] = (lora[f"{x}.lora_up.weight"], lora[f"{x}.lora_down.weight"], alpha)
            loaded |= {f"{x}.lora_up.weight", f"{x}.lora_down.weight"}
    return patches, [k for k in lora if k not in loaded]


def _comfyui_merge(weights: dict, patches: dict) -> dict:
    """LoRAAdapter.calculate_weight at strength 1: W += (alpha / down.shape[0]) * (up.flatten(1) @ down.flatten(1))
    reshaped to W (fp32 intermediate)."""
    out = dict(weights)
    for k, (up, down, alpha) in patches.items():
        scale = alpha / down.shape[0] if alpha is not None else 1.0
        diff = torch.mm(up.float().flatten(start_dim=1), down.float().flatten(start_dim=1)).reshape(out[k].shape)
        out[k] = out[k].float() + scale * diff
    return out


def _comfyui_weights(authors: dict) -> dict:
    """The weights ComfyUI's HunyuanVideo-1.5 model holds: the authors' layout with each double block's q, k, v
    rows concatenated (DoubleStreamBlock views img_attn.qkv's output as (3, heads, head_dim): rows [q; k; v]), as
    the repackaged checkpoints store `img_attn_qkv`, then process_unet_state_dict."""
    sd = dict(authors)
    for k in [k for k in sd if re.match(r"^double_blocks\.\d+\.(img|txt)_attn_q\.(weight|bias)$", k)]:
        parts = [sd.pop(k.replace("_attn_q.", f"_attn_{p}.")) for p in "qkv"]
        sd[k.replace("_attn_q.", "_attn_qkv.")] = torch.cat(parts, dim=0)
    return _comfyui_process_unet_state_dict(sd)


def _comfy_file(tmp_path, lora) -> dict[str, torch.Tensor]:
    path = lf.write_lora(lora, tmp_path, "comfy")
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_comfyui_module_names_follow_its_checkpoint_renames():
    """The module tree read in ComfyUI's model.py / layers.py is what process_unet_state_dict makes of the authors'
    keys once the double blocks' q,k,v are fused, and the split `img_attn_q` of the original checkpoint is not one
    of its weights (so a LoRA on it would not load)."""
    authors = diffusers_to_authors_transformer(_transformer().state_dict())
    comfy = _comfyui_weights(authors)
    linears = {k for k in comfy if k.endswith(".weight") and comfy[k].ndim >= 2 and "cond_type" not in k}
    assert linears == _comfyui_linears(n_double=1, n_refiner=1)
    assert "diffusion_model.double_blocks.0.img_attn_q.weight" not in comfy
    split = _comfyui_process_unet_state_dict(authors)  # the original checkpoint's split q,k,v unfused
    assert "diffusion_model.double_blocks.0.img_attn_q.weight" in split


def test_every_comfy_key_loads_in_comfyui_and_merges_like_diffusers(tmp_path):
    """Every key of the comfy export is consumed by ComfyUI's key map and loader (no "lora key not loaded"), lands on
    a weight of its shape, and ComfyUI's merge of it equals peft's diffusers-layout merge converted to ComfyUI's
    weights (fp32 rounding)."""
    tr = _with_adapter()
    lora = _comfy_file(tmp_path, _lora_of(tr))
    assert "diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight" in lora
    # comfy/lora_convert.py convert_lora passes the file through unchanged (none of its format triggers)
    assert "img_in.lora_A.weight" not in lora and "lora_unet__blocks_0_cross_attn_k.lora_down.weight" not in lora
    assert not any(re.search(r"(.*attn[._]to_)qkv(?=\.|$)", k) for k in lora)
    base = {k.replace(".base_layer.", "."): v for k, v in tr.state_dict().items() if "lora_" not in k}
    weights = _comfyui_weights(diffusers_to_authors_transformer(base))
    patches, not_loaded = _comfyui_load_lora(lora, _comfyui_key_map(weights))
    assert not not_loaded, f"ComfyUI would log 'lora key not loaded' for {not_loaded[:4]}"
    assert all(torch.mm(up.flatten(1), down.flatten(1)).numel() == weights[k].numel() for k, (up, down, _) in
               patches.items())
    n_modules = len(_lora_of(tr))  # every diffusers module is in one ComfyUI patch (q,k,v: 3 in one)
    assert len(patches) == n_modules - 3 * 2  # 3 q,k,v groups (refiner, img, txt of 1 block): 3 modules -> 1
    got = _comfyui_merge(weights, patches)
    want = _comfyui_weights(diffusers_to_authors_transformer(_peft_merged(tr)))
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k].float(), want[k].float(), rtol=1e-5, atol=1e-6, msg=k)
    changed = {k for k in want if not torch.equal(want[k], weights[k])}
    assert {"diffusion_model.double_blocks.0.img_attn.qkv.weight", "diffusion_model.double_blocks.0.img_mod.lin.weight",
            "diffusion_model.time_in.in_layer.weight", "diffusion_model.final_layer.adaLN_modulation.1.weight",
            "diffusion_model.txt_in.individual_token_refiner.blocks.0.self_attn.qkv.weight"} <= changed


def test_diffusers_to_comfy_and_back_is_identical():
    lora = _lora_of(_with_adapter())
    comfy = lf.diffusers_to_comfy_lora(lora)
    assert "double_blocks.0.txt_attn.qkv" in comfy and "double_blocks.0.txt_attn_q" not in comfy
    back = lf.comfy_to_diffusers_lora(comfy)
    assert back.keys() == lora.keys()
    for m, (a, b, alpha) in lora.items():
        a2, b2, alpha2 = back[m]
        assert torch.equal(a2, a) and torch.equal(b2, b) and alpha2 == alpha, m
    # the authors' names (split q,k,v) read as a comfy file too
    assert lf.comfy_to_diffusers_lora(lf.diffusers_to_authors_lora(lora)).keys() == lora.keys()


def test_a_lora_trained_on_comfyuis_fused_qkv_splits_exactly():
    """A fused img_attn.qkv LoRA with a full B (trained in ComfyUI) -> three diffusers LoRAs sharing A."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(4, 5, generator=g), torch.randn(12, 4, generator=g)
    split = lf.comfy_to_diffusers_lora({"double_blocks.0.img_attn.qkv": (a, b, 2.0)})
    got = torch.cat([_delta(*split[f"transformer_blocks.0.attn.to_{p}"]) for p in "qkv"])
    torch.testing.assert_close(got, _delta(a, b, 2.0), rtol=0, atol=1e-12)


def test_errors_are_one_clear_line():
    with pytest.raises(SageGRPOError, match="not HunyuanVideo-1.5 transformer modules: unet.down"):
        lf.diffusers_to_authors_lora({"unet.down": (torch.zeros(1, 2), torch.zeros(2, 1), 1.0)})
    with pytest.raises(SageGRPOError, match="not LoRA lora_A.weight/lora_B.weight pairs"):
        lf.from_peft({"a.lora_A.weight": torch.zeros(1, 2)}, {"r": 1, "lora_alpha": 1})
    with pytest.raises(SageGRPOError, match="--lora_format 'kohya' is not one of peft, diffusers, original, comfy"):
        lf.write_lora({}, "/nonexistent", "kohya")
