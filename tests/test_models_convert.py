"""Checkpoint key conversion against hand-written facts (diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py),
not against our own table run backwards: a symmetric rename of both sides would pass a round trip."""

import pytest
import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.models.convert import (
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
