"""Checkpoint key conversion against hand-written facts (diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py),
not against our own table run backwards: a symmetric rename of both sides would pass a round trip."""

import pytest
import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.models.convert import (
    authors_to_diffusers_transformer,
    authors_to_diffusers_vae,
    diffusers_to_authors_transformer,
    diffusers_to_authors_vae,
    infer_transformer_config,
)

# authors' VAE key -> diffusers' key, copied by hand from the official converter
VAE_FACTS = {
    "encoder.conv_in.conv.weight": "encoder.conv_in.conv.weight",
    "encoder.down.0.block.1.conv2.conv.weight": "encoder.down_blocks.0.resnets.1.conv2.conv.weight",
    "encoder.down.1.block.0.norm1.gamma": "encoder.down_blocks.1.resnets.0.norm1.gamma",
    "encoder.down.2.downsample.conv.conv.bias": "encoder.down_blocks.2.downsamplers.0.conv.conv.bias",
    "encoder.mid.block_1.norm2.gamma": "encoder.mid_block.resnets.0.norm2.gamma",
    "encoder.mid.block_2.conv1.conv.bias": "encoder.mid_block.resnets.1.conv1.conv.bias",
    "encoder.mid.attn_1.norm.gamma": "encoder.mid_block.attentions.0.norm.gamma",
    "encoder.mid.attn_1.q.weight": "encoder.mid_block.attentions.0.to_q.weight",
    "encoder.mid.attn_1.proj_out.bias": "encoder.mid_block.attentions.0.proj_out.bias",
    "encoder.norm_out.gamma": "encoder.norm_out.gamma",
    "encoder.conv_out.conv.bias": "encoder.conv_out.conv.bias",
    "decoder.conv_in.conv.bias": "decoder.conv_in.conv.bias",
    "decoder.mid.attn_1.k.bias": "decoder.mid_block.attentions.0.to_k.bias",
    "decoder.mid.attn_1.v.weight": "decoder.mid_block.attentions.0.to_v.weight",
    "decoder.up.3.block.2.conv1.conv.weight": "decoder.up_blocks.3.resnets.2.conv1.conv.weight",
    "decoder.up.0.upsample.conv.conv.weight": "decoder.up_blocks.0.upsamplers.0.conv.conv.weight",
    "decoder.norm_out.gamma": "decoder.norm_out.gamma",
    "decoder.conv_out.conv.weight": "decoder.conv_out.conv.weight",
}


def test_vae_keys_match_the_official_converter():
    src = {k: torch.full((2,), float(i)) for i, k in enumerate(VAE_FACTS)}
    out = authors_to_diffusers_vae(dict(src))
    assert set(out) == set(VAE_FACTS.values())
    for k, v in VAE_FACTS.items():
        assert torch.equal(out[v], src[k]), k
    back = diffusers_to_authors_vae({v: src[k] for k, v in VAE_FACTS.items()})
    assert set(back) == set(VAE_FACTS)


# authors' transformer module -> diffusers' module, copied by hand from the official converter's
# convert_hyvideo15_transformer_to_diffusers (the parameter suffixes follow); {i}: a double block, {r}: a refiner
# block. The official converter also splits the refiner's self_attn_qkv into to_q/to_k/to_v (chunks of dim 0) and
# swaps the final adaLN's halves (shift, scale) -> (scale, shift): both are checked below.
TRANSFORMER_FACTS = {
    "time_in.mlp.0": "time_embed.timestep_embedder.linear_1",
    "time_in.mlp.2": "time_embed.timestep_embedder.linear_2",
    "txt_in.t_embedder.mlp.0": "context_embedder.time_text_embed.timestep_embedder.linear_1",
    "txt_in.t_embedder.mlp.2": "context_embedder.time_text_embed.timestep_embedder.linear_2",
    "txt_in.c_embedder.linear_1": "context_embedder.time_text_embed.text_embedder.linear_1",
    "txt_in.c_embedder.linear_2": "context_embedder.time_text_embed.text_embedder.linear_2",
    "txt_in.input_embedder": "context_embedder.proj_in",
    "txt_in.individual_token_refiner.blocks.{r}.norm1": "context_embedder.token_refiner.refiner_blocks.{r}.norm1",
    "txt_in.individual_token_refiner.blocks.{r}.self_attn_proj":
        "context_embedder.token_refiner.refiner_blocks.{r}.attn.to_out.0",
    "txt_in.individual_token_refiner.blocks.{r}.norm2": "context_embedder.token_refiner.refiner_blocks.{r}.norm2",
    "txt_in.individual_token_refiner.blocks.{r}.mlp.fc1":
        "context_embedder.token_refiner.refiner_blocks.{r}.ff.net.0.proj",
    "txt_in.individual_token_refiner.blocks.{r}.mlp.fc2": "context_embedder.token_refiner.refiner_blocks.{r}.ff.net.2",
    "txt_in.individual_token_refiner.blocks.{r}.adaLN_modulation.1":
        "context_embedder.token_refiner.refiner_blocks.{r}.norm_out.linear",
    "byt5_in.layernorm": "context_embedder_2.norm",
    "byt5_in.fc1": "context_embedder_2.linear_1",
    "byt5_in.fc2": "context_embedder_2.linear_2",
    "byt5_in.fc3": "context_embedder_2.linear_3",
    "vision_in.proj.0": "image_embedder.norm_in",
    "vision_in.proj.1": "image_embedder.linear_1",
    "vision_in.proj.3": "image_embedder.linear_2",
    "vision_in.proj.4": "image_embedder.norm_out",
    "img_in.proj": "x_embedder.proj",
    "double_blocks.{i}.img_mod.linear": "transformer_blocks.{i}.norm1.linear",
    "double_blocks.{i}.txt_mod.linear": "transformer_blocks.{i}.norm1_context.linear",
    "double_blocks.{i}.img_attn_q": "transformer_blocks.{i}.attn.to_q",
    "double_blocks.{i}.img_attn_k": "transformer_blocks.{i}.attn.to_k",
    "double_blocks.{i}.img_attn_v": "transformer_blocks.{i}.attn.to_v",
    "double_blocks.{i}.img_attn_proj": "transformer_blocks.{i}.attn.to_out.0",
    "double_blocks.{i}.txt_attn_q": "transformer_blocks.{i}.attn.add_q_proj",
    "double_blocks.{i}.txt_attn_k": "transformer_blocks.{i}.attn.add_k_proj",
    "double_blocks.{i}.txt_attn_v": "transformer_blocks.{i}.attn.add_v_proj",
    "double_blocks.{i}.txt_attn_proj": "transformer_blocks.{i}.attn.to_add_out",
    "double_blocks.{i}.img_mlp.fc1": "transformer_blocks.{i}.ff.net.0.proj",
    "double_blocks.{i}.img_mlp.fc2": "transformer_blocks.{i}.ff.net.2",
    "double_blocks.{i}.txt_mlp.fc1": "transformer_blocks.{i}.ff_context.net.0.proj",
    "double_blocks.{i}.txt_mlp.fc2": "transformer_blocks.{i}.ff_context.net.2",
    "final_layer.linear": "proj_out",
}
# weight only (no bias) in the official converter: the RMS norms of q and k, and the condition-type embedding
TRANSFORMER_WEIGHT_FACTS = {
    "double_blocks.{i}.img_attn_q_norm": "transformer_blocks.{i}.attn.norm_q",
    "double_blocks.{i}.img_attn_k_norm": "transformer_blocks.{i}.attn.norm_k",
    "double_blocks.{i}.txt_attn_q_norm": "transformer_blocks.{i}.attn.norm_added_q",
    "double_blocks.{i}.txt_attn_k_norm": "transformer_blocks.{i}.attn.norm_added_k",
    "cond_type_embedding": "cond_type_embed",
}


def test_transformer_keys_match_the_official_converter():
    """Every authors' tensor (two double blocks, two refiner blocks, distinct values) lands on the diffusers key the
    official converter gives it. A round trip cannot see a rule that exchanges two keys in both directions (the text
    stream's q and k, the image and text MLPs); this can."""
    facts = {}  # authors' key -> diffusers' key (plain renames)
    for src, dst in TRANSFORMER_FACTS.items():
        for suffix in (".weight", ".bias"):
            for i in (0, 1):
                facts[src.format(i=i, r=i) + suffix] = dst.format(i=i, r=i) + suffix
    for src, dst in TRANSFORMER_WEIGHT_FACTS.items():
        for i in (0, 1):
            facts[src.format(i=i) + ".weight"] = dst.format(i=i) + ".weight"
    qkv = [f"txt_in.individual_token_refiner.blocks.{r}.self_attn_qkv{suffix}" for r in (0, 1)
           for suffix in (".weight", ".bias")]
    ada = ["final_layer.adaLN_modulation.1.weight", "final_layer.adaLN_modulation.1.bias"]
    keys = [*facts, *qkv, *ada]
    src = {k: torch.arange(6.0).reshape(6, 1) + 100.0 * n for n, k in enumerate(keys)}  # [6, 1], unique per key
    out = authors_to_diffusers_transformer(dict(src))
    expected = set(facts.values())  # the diffusers keys the official converter writes
    for k in qkv:  # official: q, k, v = chunk(qkv, 3, dim=0)
        pre = k.replace("txt_in.individual_token_refiner.blocks.", "context_embedder.token_refiner.refiner_blocks.")
        pre, suffix = pre.rsplit(".self_attn_qkv", 1)
        for name, part in zip("qkv", src[k].chunk(3, dim=0)):
            assert torch.equal(out[f"{pre}.attn.to_{name}{suffix}"], part), k
            expected.add(f"{pre}.attn.to_{name}{suffix}")
    for k in ada:  # official: swap_scale_shift, (shift, scale) -> (scale, shift)
        shift, scale = src[k].chunk(2, dim=0)
        dst = "norm_out.linear." + k.rsplit(".", 1)[1]
        assert torch.equal(out[dst], torch.cat([scale, shift])), k
        expected.add(dst)
    assert set(out) == expected
    wrong = [f"{a} -> {b}" for a, b in facts.items() if not torch.equal(out[b], src[a])]
    assert wrong == [], wrong


def test_incomplete_qkv_is_a_clear_error():
    pre = "context_embedder.token_refiner.refiner_blocks.0.attn."
    partial = {pre + "to_q.weight": torch.zeros(4, 2), pre + "to_k.weight": torch.zeros(4, 2)}
    with pytest.raises(SageGRPOError, match=r"incomplete q/k/v for txt_in\.individual_token_refiner\.blocks\.0\."
                                            r"self_attn_qkv\.weight: have \['k', 'q'\]"):
        diffusers_to_authors_transformer(partial)


@pytest.mark.parametrize("version,target_size,task", [
    ("480p_t2v", 640, "t2v"), ("480p_i2v", 640, "i2v"), ("720p_t2v", 960, "t2v"),
    ("480p_t2v_distilled", 640, "t2v"),
])
def test_target_size_and_task_follow_the_version(version, target_size, task):
    # the official TRANSFORMER_CONFIGS: 480p -> target_size 640, 720p -> 960
    d, heads = 8, 2
    state = {
        "img_in.proj.weight": torch.zeros(d * heads, 5, 1, 1, 1),
        "double_blocks.0.img_attn_q_norm.weight": torch.zeros(d),
        "final_layer.linear.weight": torch.zeros(4, d * heads),
        "double_blocks.0.img_mlp.fc1.weight": torch.zeros(4 * d * heads, d * heads),
        "txt_in.input_embedder.weight": torch.zeros(d * heads, 12),
        "byt5_in.layernorm.weight": torch.zeros(6),
        "vision_in.proj.0.weight": torch.zeros(10),
    }
    cfg = infer_transformer_config(state, version)
    assert (cfg["target_size"], cfg["task_type"]) == (target_size, task)
