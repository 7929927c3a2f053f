"""Loading both checkpoint layouts, the authors' key mapping, missing-piece errors, dtype, freezing, LoRA, DCP."""

import shutil

import pytest
import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.models.convert import (
    authors_to_diffusers_transformer,
    diffusers_to_authors_transformer,
    infer_transformer_config,
)
from sage_grpo.models.loading import load_pipeline, locate_model


def test_both_layouts_load_the_same_model(tiny_pipe, tiny_authors_dir):
    pa = load_pipeline(model_path=str(tiny_authors_dir), dtype="fp32")
    assert pa.sage_grpo_location.layout == "authors" and tiny_pipe.sage_grpo_location.layout == "diffusers"
    for a, b in ((tiny_pipe.transformer, pa.transformer), (tiny_pipe.vae, pa.vae),
                 (tiny_pipe.text_encoder, pa.text_encoder)):
        sa, sb = a.state_dict(), b.state_dict()
        assert set(sa) == set(sb)
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    # The glyph encoder of the authors' layout has extra color/font tokens; shared rows must match.
    ea = tiny_pipe.encode_prompt(['a sign says "hello"'], device="cpu", dtype=torch.float32)
    eb = pa.encode_prompt(['a sign says "hello"'], device="cpu", dtype=torch.float32)
    for x, y in zip(ea, eb):
        assert torch.equal(x, y)
    assert len(pa.tokenizer_2) == len(tiny_pipe.tokenizer_2) + 4  # 2 colors + 2 fonts in the tiny assets


def test_authors_key_mapping_facts():
    # Hand-written expectations from the official converter: renames, q/k/v split, (shift, scale) swap.
    d = 8
    qkv = torch.arange(3 * d * 2, dtype=torch.float32).reshape(3 * d, 2)
    ada = torch.arange(2 * d, dtype=torch.float32)
    src = {
        "double_blocks.3.img_attn_q.weight": torch.ones(2),
        "double_blocks.3.img_attn_q_norm.weight": torch.zeros(2),
        "double_blocks.3.txt_attn_proj.bias": torch.full((2,), 5.0),
        "txt_in.individual_token_refiner.blocks.1.self_attn_qkv.weight": qkv,
        "final_layer.adaLN_modulation.1.bias": ada,
    }
    out = authors_to_diffusers_transformer(dict(src))
    assert torch.equal(out["transformer_blocks.3.attn.to_q.weight"], torch.ones(2))
    assert torch.equal(out["transformer_blocks.3.attn.norm_q.weight"], torch.zeros(2))
    assert torch.equal(out["transformer_blocks.3.attn.to_add_out.bias"], torch.full((2,), 5.0))
    pre = "context_embedder.token_refiner.refiner_blocks.1.attn."
    assert torch.equal(out[pre + "to_q.weight"], qkv[:d]) and torch.equal(out[pre + "to_v.weight"], qkv[2 * d :])
    assert torch.equal(out["norm_out.linear.bias"], torch.cat([ada[d:], ada[:d]]))
    back = diffusers_to_authors_transformer(out)
    assert set(back) == set(src) and all(torch.equal(back[k], src[k]) for k in src)
    with pytest.raises(SageGRPOError, match="no mapping"):
        authors_to_diffusers_transformer({"not_a_hunyuan_key.weight": torch.zeros(1)})


def test_infer_config_from_authors_weights(tiny_pipe):
    state = diffusers_to_authors_transformer(tiny_pipe.transformer.state_dict())
    cfg = infer_transformer_config(state, "480p_t2v")
    real = tiny_pipe.transformer.config
    for k in ("in_channels", "out_channels", "num_attention_heads", "attention_head_dim", "num_layers",
              "num_refiner_layers", "mlp_ratio", "text_embed_dim", "text_embed_2_dim", "image_embed_dim"):
        assert cfg[k] == real[k], k
    assert tuple(cfg["rope_axes_dim"]) == tuple(real.rope_axes_dim)


def test_missing_pieces_are_listed(tiny_diffusers_dir, tmp_path):
    with pytest.raises(SageGRPOError, match="download_weights.sh"):
        locate_model(str(tmp_path / "nothing"))
    partial = tmp_path / "partial"
    shutil.copytree(tiny_diffusers_dir, partial)
    shutil.rmtree(partial / "vae")
    shutil.rmtree(partial / "tokenizer_2")
    with pytest.raises(SageGRPOError) as e:
        locate_model(model_path=str(partial))
    msg = str(e.value)
    assert "vae/" in msg and "tokenizer_2/" in msg and "transformer/" not in msg and "download_weights.sh" in msg


def test_missing_authors_glyph(tiny_authors_dir, tmp_path):
    partial = tmp_path / "a"
    shutil.copytree(tiny_authors_dir, partial)
    (partial / "text_encoder/Glyph-SDXL-v2/checkpoints/byt5_model.pt").unlink()
    with pytest.raises(SageGRPOError, match="Glyph-SDXL-v2/checkpoints/byt5_model.pt"):
        locate_model(model_path=str(partial))


def test_dtype_and_frozen_parts(tiny_diffusers_dir):
    pipe = load_pipeline(model_path=str(tiny_diffusers_dir), dtype="bf16", transformer_dtype="fp32")
    assert pipe.transformer.dtype == torch.float32
    assert pipe.text_encoder.dtype == torch.bfloat16 and pipe.vae.dtype == torch.bfloat16
    for m in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        assert not any(p.requires_grad for p in m.parameters())
    assert pipe.tokenizer_max_length == 64  # tiny text lengths re-applied after loading


def test_lora_and_full_finetune(tiny_diffusers_dir, tmp_path):
    from sage_grpo.models.lora import default_lora_targets, save_lora, setup_trainable

    pipe = load_pipeline(model_path=str(tiny_diffusers_dir), dtype="fp32")
    tr = pipe.transformer
    n_targets = len(default_lora_targets(tr))
    params = setup_trainable(tr, use_lora=True, lora_r=4, lora_alpha=8)
    names = [n for n, p in tr.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names) and len(params) == 2 * n_targets
    assert all(n.startswith("transformer_blocks.") for n in names)
    # A new adapter is a no-op (B = 0); after changing B, save -> load into a fresh model reproduces it.
    with torch.no_grad():
        for n, p in tr.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    path = save_lora(tr, tmp_path / "lora")
    fresh = load_pipeline(model_path=str(tiny_diffusers_dir), dtype="fp32").transformer
    setup_trainable(fresh, use_lora=True, lora_r=4, lora_alpha=8, pretrained_lora_path=str(path))
    a, b = tr.state_dict(), fresh.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The saved adapter_config.json sets r / alpha / targets: other flags cannot load it at the wrong strength.
    other_flags = load_pipeline(model_path=str(tiny_diffusers_dir), dtype="fp32").transformer
    setup_trainable(other_flags, use_lora=True, lora_r=16, lora_alpha=1, lora_target_modules=["to_q"],
                    pretrained_lora_path=str(path))
    assert other_flags.peft_config["default"].lora_alpha == 8 and other_flags.peft_config["default"].r == 4
    c = other_flags.state_dict()
    assert all(torch.equal(a[k], c[k]) for k in a)
    (path.parent / "adapter_config.json").unlink()  # without settings, a mismatch is a clear error
    wrong = load_pipeline(model_path=str(tiny_diffusers_dir), dtype="fp32").transformer
    with pytest.raises(SageGRPOError, match="does not fit"):
        setup_trainable(wrong, use_lora=True, lora_r=4, lora_target_modules=["to_q"], pretrained_lora_path=str(path))
    full = load_pipeline(model_path=str(tiny_diffusers_dir), dtype="fp32").transformer
    assert len(setup_trainable(full, use_lora=False)) == len(list(full.parameters()))
    assert all(p.requires_grad for p in full.parameters())


def test_dcp_checkpoint_loads(tiny_diffusers_dir, tmp_path):
    import torch.distributed.checkpoint as dcp

    from sage_grpo.models.lora import load_dcp_transformer

    src = load_pipeline(model_path=str(tiny_diffusers_dir), dtype="fp32").transformer
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
    dcp.save({"model": src.state_dict()}, checkpoint_id=str(tmp_path / "checkpoint-3/transformer"))
    dst = load_pipeline(model_path=str(tiny_diffusers_dir), dtype="fp32").transformer
    load_dcp_transformer(dst, tmp_path / "checkpoint-3/transformer")
    a, b = src.state_dict(), dst.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # A checkpoint whose keys do not fit (here: a LoRA-wrapped model's) is one clear user error, not a traceback.
    from sage_grpo.models.lora import setup_trainable

    setup_trainable(src, use_lora=True, lora_r=2, lora_alpha=2)
    dcp.save({"model": src.state_dict()}, checkpoint_id=str(tmp_path / "checkpoint-4/transformer"))
    with pytest.raises(SageGRPOError, match="does not fit this transformer"):
        load_dcp_transformer(dst, tmp_path / "checkpoint-4/transformer")
    with pytest.raises(SageGRPOError, match="not a DCP"):
        load_dcp_transformer(dst, tmp_path)


@pytest.mark.slow
def test_convert_script_writes_a_diffusers_layout(tiny_authors_dir, tiny_pipe, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts/convert_authors_checkpoint.py"
    out = tmp_path / "converted"
    subprocess.run([sys.executable, str(script), "--pretrained_model_root", str(tiny_authors_dir), "--out", str(out),
                    "--dtype", "fp32"], check=True, timeout=300)
    conv = load_pipeline(model_path=str(out), dtype="fp32")
    assert conv.sage_grpo_location.layout == "diffusers"
    a, b = conv.transformer.state_dict(), tiny_pipe.transformer.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_prebuilt_transformer_and_row_reader(tiny_diffusers_dir, tiny_authors_dir, monkeypatch):
    """FSDP2 hooks: load_pipeline takes a built (sharded) transformer instead of loading one; the row reader returns
    exactly a tensor's rows from the diffusers safetensors."""
    import diffusers
    from safetensors.torch import load_file

    from sage_grpo.models.loading import read_transformer_config, transformer_row_reader

    def refuse(*a, **k):
        raise AssertionError("the transformer must not be loaded")

    monkeypatch.setattr(diffusers.HunyuanVideo15Transformer3DModel, "from_pretrained", refuse)
    config = read_transformer_config(tiny_diffusers_dir / "transformer")
    built = diffusers.HunyuanVideo15Transformer3DModel.from_config(config)
    pipe = load_pipeline(model_path=str(tiny_diffusers_dir), dtype="fp32", transformer=built)
    assert pipe.transformer is built and pipe.vae is not None
    with pytest.raises(SageGRPOError, match="diffusers layout"):
        load_pipeline(model_path=str(tiny_authors_dir), dtype="fp32", transformer=built)
    saved = load_file(next((tiny_diffusers_dir / "transformer").glob("*.safetensors")))
    key = "transformer_blocks.0.attn.to_q.weight"
    with transformer_row_reader(tiny_diffusers_dir / "transformer") as read:
        assert torch.equal(read(key, 5, 9), saved[key][5:9])
        with pytest.raises(SageGRPOError, match="missing"):
            read("no.such.weight", 0, 1)
