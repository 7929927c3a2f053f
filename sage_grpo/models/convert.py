"""Key mapping between the authors' HunyuanVideo-1.5 checkpoints and diffusers' classes.

diffusers keeps its converter (`scripts/convert_hunyuan_video1_5_to_diffusers.py`) in its source repository, not in
the wheel, so this is our own table built from the same facts: module paths are renamed, the token refiner's fused
`self_attn_qkv` is split into to_q/to_k/to_v (chunks of dim 0), and the final layer's adaLN modulation stores
(shift, scale) where diffusers' AdaLayerNormContinuous expects (scale, shift). Every rule is a module-path prefix
with `{i}`/`{j}` block indices; the rest of the key (`.weight`, `.bias`, `.gamma`, `.conv.weight`) is kept. The
same table run backwards writes tiny checkpoints in the authors' layout (scripts/make_tiny_checkpoint.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import Tensor

from sage_grpo.errors import SageGRPOError

__all__ = [
    "TRANSFORMER_RULES",
    "VAE_RULES",
    "authors_to_diffusers_transformer",
    "diffusers_to_authors_transformer",
    "authors_to_diffusers_vae",
    "diffusers_to_authors_vae",
    "infer_transformer_config",
]

# (authors' module path, diffusers' module path, op). op: "" rename, "qkv" split/fuse q,k,v, "swap" (shift, scale).
TRANSFORMER_RULES: list[tuple[str, str, str]] = [
    ("time_in.mlp.0", "time_embed.timestep_embedder.linear_1", ""),
    ("time_in.mlp.2", "time_embed.timestep_embedder.linear_2", ""),
    # the step-distilled model's r-timestep embedder (use_meanflow; the authors' time_r_in, diffusers' converter)
    ("time_r_in.mlp.0", "time_embed.timestep_embedder_r.linear_1", ""),
    ("time_r_in.mlp.2", "time_embed.timestep_embedder_r.linear_2", ""),
    ("txt_in.t_embedder.mlp.0", "context_embedder.time_text_embed.timestep_embedder.linear_1", ""),
    ("txt_in.t_embedder.mlp.2", "context_embedder.time_text_embed.timestep_embedder.linear_2", ""),
    ("txt_in.c_embedder.linear_1", "context_embedder.time_text_embed.text_embedder.linear_1", ""),
    ("txt_in.c_embedder.linear_2", "context_embedder.time_text_embed.text_embedder.linear_2", ""),
    ("txt_in.input_embedder", "context_embedder.proj_in", ""),
    ("txt_in.individual_token_refiner.blocks.{i}.norm1", "context_embedder.token_refiner.refiner_blocks.{i}.norm1", ""),
    ("txt_in.individual_token_refiner.blocks.{i}.norm2", "context_embedder.token_refiner.refiner_blocks.{i}.norm2", ""),
    ("txt_in.individual_token_refiner.blocks.{i}.self_attn_qkv",
     "context_embedder.token_refiner.refiner_blocks.{i}.attn.to_{qkv}", "qkv"),
    ("txt_in.individual_token_refiner.blocks.{i}.self_attn_proj",
     "context_embedder.token_refiner.refiner_blocks.{i}.attn.to_out.0", ""),
    ("txt_in.individual_token_refiner.blocks.{i}.mlp.fc1",
     "context_embedder.token_refiner.refiner_blocks.{i}.ff.net.0.proj", ""),
    ("txt_in.individual_token_refiner.blocks.{i}.mlp.fc2",
     "context_embedder.token_refiner.refiner_blocks.{i}.ff.net.2", ""),
    ("txt_in.individual_token_refiner.blocks.{i}.adaLN_modulation.1",
     "context_embedder.token_refiner.refiner_blocks.{i}.norm_out.linear", ""),
    ("byt5_in.layernorm", "context_embedder_2.norm", ""),
    ("byt5_in.fc1", "context_embedder_2.linear_1", ""),
    ("byt5_in.fc2", "context_embedder_2.linear_2", ""),
    ("byt5_in.fc3", "context_embedder_2.linear_3", ""),
    ("vision_in.proj.0", "image_embedder.norm_in", ""),
    ("vision_in.proj.1", "image_embedder.linear_1", ""),
    ("vision_in.proj.3", "image_embedder.linear_2", ""),
    ("vision_in.proj.4", "image_embedder.norm_out", ""),
    ("img_in.proj", "x_embedder.proj", ""),
    ("cond_type_embedding", "cond_type_embed", ""),
    ("double_blocks.{i}.img_mod.linear", "transformer_blocks.{i}.norm1.linear", ""),
    ("double_blocks.{i}.txt_mod.linear", "transformer_blocks.{i}.norm1_context.linear", ""),
    ("double_blocks.{i}.img_attn_q", "transformer_blocks.{i}.attn.to_q", ""),
    ("double_blocks.{i}.img_attn_k", "transformer_blocks.{i}.attn.to_k", ""),
    ("double_blocks.{i}.img_attn_v", "transformer_blocks.{i}.attn.to_v", ""),
    ("double_blocks.{i}.img_attn_q_norm", "transformer_blocks.{i}.attn.norm_q", ""),
    ("double_blocks.{i}.img_attn_k_norm", "transformer_blocks.{i}.attn.norm_k", ""),
    ("double_blocks.{i}.img_attn_proj", "transformer_blocks.{i}.attn.to_out.0", ""),
    ("double_blocks.{i}.txt_attn_q", "transformer_blocks.{i}.attn.add_q_proj", ""),
    ("double_blocks.{i}.txt_attn_k", "transformer_blocks.{i}.attn.add_k_proj", ""),
    ("double_blocks.{i}.txt_attn_v", "transformer_blocks.{i}.attn.add_v_proj", ""),
    ("double_blocks.{i}.txt_attn_q_norm", "transformer_blocks.{i}.attn.norm_added_q", ""),
    ("double_blocks.{i}.txt_attn_k_norm", "transformer_blocks.{i}.attn.norm_added_k", ""),
    ("double_blocks.{i}.txt_attn_proj", "transformer_blocks.{i}.attn.to_add_out", ""),
    ("double_blocks.{i}.img_mlp.fc1", "transformer_blocks.{i}.ff.net.0.proj", ""),
    ("double_blocks.{i}.img_mlp.fc2", "transformer_blocks.{i}.ff.net.2", ""),
    ("double_blocks.{i}.txt_mlp.fc1", "transformer_blocks.{i}.ff_context.net.0.proj", ""),
    ("double_blocks.{i}.txt_mlp.fc2", "transformer_blocks.{i}.ff_context.net.2", ""),
    ("final_layer.adaLN_modulation.1", "norm_out.linear", "swap"),
    ("final_layer.linear", "proj_out", ""),
]

# The VAE: the authors' `down.{i}.block.{j}` / `mid.block_1` / `mid.attn_1.q` become diffusers' down_blocks/resnets/
# attentions; ResNet norms keep their `gamma` names, so prefixes are enough.
VAE_RULES: list[tuple[str, str, str]] = []
for _part, _blocks, _samplers, _sampler in (
    ("encoder", "down", "down_blocks", "downsample"),
    ("decoder", "up", "up_blocks", "upsample"),
):
    VAE_RULES += [
        (f"{_part}.conv_in", f"{_part}.conv_in", ""),
        (f"{_part}.conv_out", f"{_part}.conv_out", ""),
        (f"{_part}.norm_out", f"{_part}.norm_out", ""),
        (f"{_part}.{_blocks}.{{i}}.block.{{j}}", f"{_part}.{_samplers}.{{i}}.resnets.{{j}}", ""),
        (f"{_part}.{_blocks}.{{i}}.{_sampler}.conv", f"{_part}.{_samplers}.{{i}}.{_sampler}rs.0.conv", ""),
        (f"{_part}.mid.block_1", f"{_part}.mid_block.resnets.0", ""),
        (f"{_part}.mid.block_2", f"{_part}.mid_block.resnets.1", ""),
        (f"{_part}.mid.attn_1.norm", f"{_part}.mid_block.attentions.0.norm", ""),
        (f"{_part}.mid.attn_1.q", f"{_part}.mid_block.attentions.0.to_q", ""),
        (f"{_part}.mid.attn_1.k", f"{_part}.mid_block.attentions.0.to_k", ""),
        (f"{_part}.mid.attn_1.v", f"{_part}.mid_block.attentions.0.to_v", ""),
        (f"{_part}.mid.attn_1.proj_out", f"{_part}.mid_block.attentions.0.proj_out", ""),
    ]


def _pattern(path: str) -> re.Pattern:
    """'double_blocks.{i}.img_mod.linear' -> regex matching 'double_blocks.3.img_mod.linear.weight' (rest kept)."""
    rx = re.escape(path).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{j\}", r"(?P<j>\d+)")
    rx = rx.replace(r"\{qkv\}", r"(?P<qkv>[qkv])")
    return re.compile(rf"^{rx}(?P<rest>\..+)$")


def _fill(path: str, m: re.Match, **extra: str) -> str:
    groups = {k: v for k, v in m.groupdict().items() if v is not None and k != "rest"}
    groups.update(extra)
    out = path
    for k, v in groups.items():
        out = out.replace("{" + k + "}", v)
    return out + m.group("rest")


def _swap_halves(t: Tensor) -> Tensor:
    """(shift, scale) <-> (scale, shift) along dim 0; its own inverse."""
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def _convert(state: dict[str, Tensor], rules: Iterable[tuple[str, str, str]], forward: bool, what: str) -> dict:
    """Apply `rules` authors -> diffusers (forward) or diffusers -> authors. Unmatched keys are an error."""
    compiled = [(_pattern(src if forward else dst), src, dst, op) for src, dst, op in rules]
    out: dict[str, Tensor] = {}
    pending_fuse: dict[str, dict[str, Tensor]] = {}  # authors' qkv key -> {"q": W_q, ...} (backward only)
    unmatched = []
    for key, value in state.items():
        for rx, src, dst, op in compiled:
            m = rx.match(key)
            if m is None:
                continue
            if forward:
                if op == "qkv":
                    for name, part in zip("qkv", value.chunk(3, dim=0)):  # [3*D, ...] -> 3 x [D, ...]
                        out[_fill(dst, m, qkv=name)] = part.contiguous()
                else:
                    out[_fill(dst, m)] = _swap_halves(value) if op == "swap" else value
            else:
                if op == "qkv":
                    pending_fuse.setdefault(_fill(src, m), {})[m.group("qkv")] = value
                else:
                    out[_fill(src, m)] = _swap_halves(value) if op == "swap" else value
            break
        else:
            unmatched.append(key)
    for key, parts in pending_fuse.items():
        if set(parts) != {"q", "k", "v"}:
            raise SageGRPOError(f"{what}: incomplete q/k/v for {key}: have {sorted(parts)}")
        out[key] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    if unmatched:
        shown = ", ".join(unmatched[:8]) + (" ..." if len(unmatched) > 8 else "")
        raise SageGRPOError(f"{what}: {len(unmatched)} keys have no mapping (not a HunyuanVideo-1.5 checkpoint?): "
                            f"{shown}")
    return out


def authors_to_diffusers_transformer(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return _convert(state, TRANSFORMER_RULES, True, "transformer (authors' layout)")


def diffusers_to_authors_transformer(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return _convert(state, TRANSFORMER_RULES, False, "transformer (diffusers layout)")


def authors_to_diffusers_vae(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return _convert(state, VAE_RULES, True, "VAE (authors' layout)")


def diffusers_to_authors_vae(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return _convert(state, VAE_RULES, False, "VAE (diffusers layout)")


def _count_indices(keys: Iterable[str], prefix: str) -> int:
    rx = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
    found = {int(m.group(1)) for k in keys if (m := rx.match(k))}
    return max(found) + 1 if found else 0


def infer_transformer_config(state: dict[str, Tensor], version: str = "480p_t2v", rope_axes_dim=None) -> dict:
    """HunyuanVideo15Transformer3DModel kwargs read off an authors'-layout state dict (shapes, block counts) and
    the version name (t2v/i2v, 480p/720p). The rope split is not in the weights: (d/8, 7d/16, 7d/16) of the head
    dim d, which is the real (16, 56, 56) for d = 128, unless given."""
    w_in = state["img_in.proj.weight"]  # Conv3d [inner, in_channels, p_t, p, p]
    inner, in_channels, p_t, p = w_in.shape[0], w_in.shape[1], w_in.shape[2], w_in.shape[3]
    head_dim = state["double_blocks.0.img_attn_q_norm.weight"].shape[0]
    out_features = state["final_layer.linear.weight"].shape[0]
    if rope_axes_dim is None:
        rope_axes_dim = (head_dim // 8, 7 * head_dim // 16, 7 * head_dim // 16)
    return dict(
        in_channels=in_channels,
        out_channels=out_features // (p_t * p * p),
        num_attention_heads=inner // head_dim,
        attention_head_dim=head_dim,
        num_layers=_count_indices(state, "double_blocks"),
        num_refiner_layers=_count_indices(state, "txt_in.individual_token_refiner.blocks"),
        mlp_ratio=state["double_blocks.0.img_mlp.fc1.weight"].shape[0] / inner,
        patch_size=p,
        patch_size_t=p_t,
        qk_norm="rms_norm",
        text_embed_dim=state["txt_in.input_embedder.weight"].shape[1],
        text_embed_2_dim=state["byt5_in.layernorm.weight"].shape[0],
        image_embed_dim=state["vision_in.proj.0.weight"].shape[0],
        rope_theta=256.0,
        rope_axes_dim=tuple(int(x) for x in rope_axes_dim),
        target_size=960 if version.startswith("720p") else 640,
        task_type="i2v" if "i2v" in version else "t2v",
        use_meanflow="time_r_in.mlp.0.weight" in state,  # only the step-distilled model has the r embedder
    )
