"""The real HunyuanVideo-1.5 shapes (meta device) and the shard-by-shard random checkpoint writer
(sage_grpo.models.full_size), written at a miniature size through the same code and loaded through load_pipeline."""

import json

import pytest
import torch

from sage_grpo.models.full_size import (
    REAL_BLOCK_PARAMS,
    REAL_TRANSFORMER_PARAMS,
    build_on_meta,
    miniature_configs,
    real_configs,
    write_full_size_checkpoint,
)


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_real_transformer_and_encoders_have_the_published_sizes_on_the_meta_device():
    cfg = real_configs("480p_i2v")
    tr = build_on_meta("transformer", cfg["transformer"])
    assert _count(tr) == REAL_TRANSFORMER_PARAMS == 8_326_608_160
    assert len(tr.transformer_blocks) == 54
    assert all(_count(b) == REAL_BLOCK_PARAMS for b in tr.transformer_blocks)
    assert all(p.is_meta for p in tr.parameters())  # nothing allocated
    assert tr.config.task_type == "i2v" and tr.config.target_size == 640
    # Qwen2.5-VL-7B's text tower (no lm_head): 7.07B; SigLIP so400m's vision tower: 0.43B; ByT5-small's encoder
    assert _count(build_on_meta("text_encoder", cfg["text_encoder"])) == 7_070_619_136
    assert _count(build_on_meta("image_encoder", cfg["image_encoder"])) == 428_225_600
    assert build_on_meta("vae", cfg["vae"]).config.latent_channels == 32
    assert "image_encoder" not in real_configs("480p_t2v")
    assert real_configs("720p_t2v")["transformer"]["target_size"] == 960


def test_miniature_checkpoint_writes_in_shards_and_loads_through_the_real_path(tmp_path):
    from safetensors import safe_open

    from sage_grpo.models.loading import load_pipeline

    out = write_full_size_checkpoint(tmp_path / "ck", "480p_i2v", configs=miniature_configs("480p_i2v"),
                                     max_shard_size="200KB", log=lambda _: None)
    index = json.loads((out / "transformer/diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1  # written in several files, as the 8.3B model is
    with safe_open(str(out / "transformer" / sorted(shards)[0]), "pt") as f:
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
    pipe = load_pipeline(model_path=str(out), dtype="bf16")
    assert type(pipe).__name__ == "HunyuanVideo15ImageToVideoPipeline"
    assert pipe.transformer.config.num_layers == 2 and pipe.image_encoder is not None
    assert pipe.vision_num_semantic_tokens == 4  # (28 / 14)^2 image tokens of the miniature SigLIP
    # every stored tensor reached the model: no parameter left at its initialisation (norm scales are ones)
    sd = pipe.transformer.state_dict()
    name = "transformer_blocks.0.attn.to_q.weight"
    with safe_open(str(out / "transformer" / index["weight_map"][name]), "pt") as f:
        assert torch.equal(sd[name], f.get_tensor(name))
    assert 0.015 < sd[name].float().std() < 0.025


def test_tensor_values_depend_on_seed_and_name_only(tmp_path):
    """The same seed gives the same tensors whatever the shard plan (so T2V and I2V checkpoints share weights)."""
    from safetensors.torch import load_file

    cfg = {"vae": miniature_configs()["vae"]}
    a = write_full_size_checkpoint(tmp_path / "a", configs=cfg, max_shard_size="50KB", log=lambda _: None)
    b = write_full_size_checkpoint(tmp_path / "b", configs=cfg, max_shard_size="10GB", log=lambda _: None)
    c = write_full_size_checkpoint(tmp_path / "c", configs=cfg, seed=1, log=lambda _: None)

    def tensors(root):
        out = {}
        for f in sorted((root / "vae").glob("*.safetensors")):
            out.update(load_file(f))
        return out

    ta, tb, tc = tensors(a), tensors(b), tensors(c)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    w = next(k for k in ta if ta[k].ndim > 1)
    assert not torch.equal(ta[w], tc[w])


def test_text_layers_out_of_range_is_refused():
    with pytest.raises(ValueError, match="text_layers"):
        real_configs("480p_t2v", text_layers=2)


def test_authors_layout_at_miniature_size_loads_equal_to_the_diffusers_one_and_converts_back(tmp_path):
    """The authors' layout writer (one transformer file in their key names, the whole Qwen2.5-VL, the glyph .pt,
    SigLIP) gives every tensor the diffusers writer's values: both load equal through load_pipeline, and
    scripts/convert_authors_checkpoint.py's output holds exactly the written values (real_size_cpu's check)."""
    from helpers import load_script
    from safetensors import safe_open

    from sage_grpo.models.full_size import write_authors_checkpoint
    from sage_grpo.models.loading import load_pipeline

    cfg = miniature_configs("480p_i2v")
    authors = write_authors_checkpoint(tmp_path / "a", "480p_i2v", configs=cfg, max_shard_size="200KB",
                                       log=lambda _: None)
    diffusers = write_full_size_checkpoint(tmp_path / "d", "480p_i2v", configs=cfg, max_shard_size="200KB",
                                           log=lambda _: None)
    files = list((authors / "transformer/480p_i2v").glob("*.safetensors"))
    assert len(files) == 1  # one file, as the authors ship it, in their key names
    with safe_open(str(files[0]), "pt") as f:
        keys = set(f.keys())
        assert "double_blocks.0.img_attn_q.weight" in keys and "final_layer.adaLN_modulation.1.weight" in keys
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in keys)
    with safe_open(str(next((authors / "text_encoder/llm").glob("model*.safetensors"))), "pt") as f:
        assert any(k.startswith("visual.") for k in f.keys())  # the whole Qwen2.5-VL, hub key names
    a = load_pipeline(str(authors), "", "480p_i2v", dtype="bf16")
    d = load_pipeline(model_path=str(diffusers), dtype="bf16")
    for component in ("transformer", "vae", "text_encoder", "image_encoder"):
        sa, sd = getattr(a, component).state_dict(), getattr(d, component).state_dict()
        assert sa.keys() == sd.keys()
        assert all(torch.equal(sa[k], sd[k]) for k in sa), component
    # the glyph encoder: the same values in every tensor but the embedding, which has the colour and font rows too
    ga, gd = a.text_encoder_2.state_dict(), d.text_encoder_2.state_dict()
    assert ga["shared.weight"].shape[0] > gd["shared.weight"].shape[0]
    assert all(torch.equal(ga[k], gd[k]) for k in gd if "embed" not in k and "shared" not in k)

    load_script("scripts/convert_authors_checkpoint.py").main([
        "--pretrained_model_root", str(authors), "--pretrained_transformer_version", "480p_i2v",
        "--out", str(tmp_path / "c")])
    rs = load_script("scripts/real_size_cpu.py", register=True)
    check = rs.check_converted(tmp_path / "c")
    assert set(check) == {"transformer", "vae", "text_encoder", "image_encoder"}
    assert all(v["unequal"] == 0 and v["tensors"] > 10 for v in check.values()), check
    # the check can fail: one changed value is found
    from safetensors.torch import load_file, save_file

    name = "transformer_blocks.0.attn.to_q.weight"
    path = tmp_path / "c/transformer/diffusion_pytorch_model.safetensors"  # one file below 5 GB
    state = load_file(str(path))
    state[name] = state[name].clone()
    state[name][0, 0] += 1
    save_file(state, str(path))
    assert rs.check_converted(tmp_path / "c")["transformer"]["unequal"] == 1
