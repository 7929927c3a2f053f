"""HunyuanVideo-1.5's Ulysses plan: sequence parallelism for diffusers' `HunyuanVideo15Transformer3DModel`, over
valid tokens only, built on the model-agnostic machinery of `sage_grpo.parallel.ulysses`.

`enable_sequence_parallel(transformer, sp_group)` installs hooks and an attention processor; the transformer's
public forward keeps its full-size inputs and outputs. Every rank of the sp group must call it with IDENTICAL full
inputs (latents, text embeddings and masks, timestep): derive them from shared seeds or broadcast them, never rely
on RNG lockstep. Inside:

- after the patch embedding (`x_embedder`) the S video tokens are padded with zeros to a multiple of P (the sp
  size) and each rank keeps its contiguous chunk of S_pad / P tokens; the rotary table (`rope`) is cut the same way,
  so every token keeps its own position;
- in every dual-stream block, the processor projects its local video tokens, applies QK-norm and rotary, and one
  all-to-all turns q/k/v from [B, S_pad/P, H, d] into [B, S_pad, H/P, d] (all tokens, my heads); the pad tokens are
  dropped there, the text tokens (replicated on every rank, so never all-to-all'd and never double counted) are
  cut to the same H/P heads, and attention runs over each sample's valid tokens only, as in
  `sage_grpo.models.attention` (the padding-cut block hook applies unchanged). The video output goes back through
  the inverse all-to-all; the text output is all-gathered over heads (every rank carries the full text stream);
- at `proj_out` the video tokens are all-gathered and the pad cut off, so every rank returns the same full
  velocity [B, C, F, H, W]. Everything downstream (SDE step, log-prob, loss) is then identical on every sp rank.

Gradients are partial on each sp rank: their sum over the sp group is the full gradient (the convention of
`sage_grpo.parallel.ulysses`, where the caller's duties are spelled out).

Limits: P must divide the head count (16 for HunyuanVideo-1.5). Dropout must be 0 on the replicated text path
(each rank would drop different activations); LoRA dropout is 0 by default.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sage_grpo.errors import SageGRPOError
from sage_grpo.models.attention import (
    ValidTokenAttnProcessor,
    dual_stream_blocks,
    encoder_qkv,
    prefix_attention,
    use_valid_token_attention,
    valid_lengths,
)
from sage_grpo.parallel.ulysses import (
    GatherTokensHook,
    ShardTokensHook,
    SPState,
    gather_heads,
    heads_to_seq,
    seq_to_heads,
    shard_tokens,
)

__all__ = [
    "UlyssesAttnProcessor",
    "enable_sequence_parallel",
    "disable_sequence_parallel",
    "sequence_parallel_enabled",
]


class UlyssesAttnProcessor(ValidTokenAttnProcessor):
    """`ValidTokenAttnProcessor` under Ulysses: local video tokens in, all-to-all to a head split, valid-token
    attention over all video tokens and my heads of the (replicated) text tokens, all-to-all back."""

    def __init__(self, state: SPState):
        self.state = state

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        if image_rotary_emb is None or len(image_rotary_emb) != 3:
            raise SageGRPOError("UlyssesAttnProcessor runs only inside a transformer set up by "
                                "enable_sequence_parallel")
        # cos/sin: [S_loc, d], my tokens' rows; n_video: unpadded S, carried in the rotary tuple (not read from the
        # state) so that a checkpointed block's recompute never reads a later forward's length
        cos, sin, n_video = image_rotary_emb
        st = self.state
        heads = attn.heads // st.size
        mine = slice(st.rank * heads, (st.rank + 1) * heads)
        # 1-3: projections, QK-norm, rotary on my video tokens: [B, S_loc, H, d]
        query = attn.norm_q(attn.to_q(hidden_states).unflatten(2, (attn.heads, -1)))
        key = attn.norm_k(attn.to_k(hidden_states).unflatten(2, (attn.heads, -1)))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        query = apply_rotary_emb(query, (cos, sin), sequence_dim=1)
        key = apply_rotary_emb(key, (cos, sin), sequence_dim=1)
        batch, s_loc = hidden_states.shape[:2]
        # one all-to-all for q, k, v: [3B, S_loc, H, d] -> [3B, S_pad, H/P, d]; drop the pad tokens -> [3B, S, H/P, d]
        qkv = seq_to_heads(torch.cat([query, key, value]), st.group)[:, :n_video]
        query, key, value = qkv.chunk(3)
        # 4: text tokens, replicated: project all heads (LoRA-wrapped layers stay whole), keep mine: [B, T, H/P, d]
        n_enc = 0
        if encoder_hidden_states is not None:
            n_enc = encoder_hidden_states.shape[1]
            eq, ek, ev = encoder_qkv(attn, encoder_hidden_states)
            query = torch.cat([query, eq[:, :, mine]], dim=1)  # [B, S + T, H/P, d]
            key = torch.cat([key, ek[:, :, mine]], dim=1)
            value = torch.cat([value, ev[:, :, mine]], dim=1)
        # 5: each sample attends over its valid prefix (all video tokens + its valid text tokens)
        lengths = [n_video + n for n in valid_lengths(attention_mask, batch, n_enc)]
        # [B, S + T, H/P, d]
        out = prefix_attention(query, key, value, lengths, self._attention_backend).to(query.dtype)
        video = out[:, :n_video]
        pad = s_loc * st.size - n_video
        if pad:  # the pad tokens get zero attention output (they are cut at proj_out)
            video = torch.cat([video, video.new_zeros(batch, pad, *video.shape[2:])], dim=1)
        video = heads_to_seq(video, st.group).flatten(2, 3)  # [B, S_loc, H*d]
        # 6: output projections
        video = attn.to_out[1](attn.to_out[0](video))
        if encoder_hidden_states is None:
            return video, None
        text = gather_heads(out[:, n_video:], st.group).flatten(2, 3)  # [B, T, H*d], the same on every rank
        return video, attn.to_add_out(text)


class _RopeHook:
    """rope output (cos, sin) [S, d] -> (my rows of cos, of sin, S)."""

    def __init__(self, state: SPState):
        self.state = state

    def __call__(self, module, args, output):
        cos, sin = output
        st = self.state
        return shard_tokens(cos, st.size, st.rank, 0), shard_tokens(sin, st.size, st.rank, 0), cos.shape[0]


_HOOK_TYPES = (_RopeHook, ShardTokensHook, GatherTokensHook)


def _remove_hooks(transformer) -> None:
    for module in (transformer.rope, transformer.x_embedder, transformer.proj_out):
        for key in [k for k, h in module._forward_hooks.items() if isinstance(h, _HOOK_TYPES)]:
            del module._forward_hooks[key]


def enable_sequence_parallel(transformer, sp_group):
    """Run `transformer` (a HunyuanVideo15Transformer3DModel) with Ulysses sequence parallelism over `sp_group`.
    No-op when the group is None or has one rank. Returns the transformer. Full inputs in, full output out, on
    every rank; parameter and input gradients are partial: sum them over the sp group (module docstring)."""
    if sp_group is None or dist.get_world_size(sp_group) == 1:
        return transformer
    blocks = dual_stream_blocks(transformer)
    sp = dist.get_world_size(sp_group)
    heads = blocks[0].attn.heads
    if heads % sp:
        raise SageGRPOError(f"--sp_size {sp} must divide the attention head count {heads}")
    drop = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    if drop:
        raise SageGRPOError(f"sequence parallelism needs dropout 0 (each rank would drop different text activations); "
                            f"{drop[0]} has p > 0 (set --lora_dropout 0)")
    disable_sequence_parallel(transformer)
    # valid-token attention first: its padding-cut block hook (idempotent) serves this processor unchanged
    use_valid_token_attention(transformer)
    state = SPState(sp_group)
    for block in blocks:
        proc = UlyssesAttnProcessor(state)
        proc._attention_backend = block.attn.processor._attention_backend
        block.attn.set_processor(proc)
    transformer.rope.register_forward_hook(_RopeHook(state))
    transformer.x_embedder.register_forward_hook(ShardTokensHook(state))
    transformer.proj_out.register_forward_hook(GatherTokensHook(state))
    return transformer


def disable_sequence_parallel(transformer):
    """Back to single-process valid-token attention (every rank computes everything). Returns the transformer."""
    if sequence_parallel_enabled(transformer):
        for block in dual_stream_blocks(transformer):
            proc = ValidTokenAttnProcessor()
            proc._attention_backend = block.attn.processor._attention_backend
            block.attn.set_processor(proc)
    _remove_hooks(transformer)
    return transformer


def sequence_parallel_enabled(transformer) -> bool:
    return any(isinstance(b.attn.processor, UlyssesAttnProcessor) for b in dual_stream_blocks(transformer))
