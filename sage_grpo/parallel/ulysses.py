"""Ulysses sequence parallelism for diffusers' `HunyuanVideo15Transformer3DModel`, over valid tokens only.

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

GRADIENTS (what the caller must do). Every sp rank computes the same full loss from the same full output; the
gather's backward keeps only the local chunk of the output gradient, so each rank back-propagates its own video
tokens (and 1/P of the replicated text path through its heads). After `backward()` each rank's parameter
gradients, and the gradients of the inputs, are partial: THE FULL GRADIENT IS THE SUM OVER THE SP GROUP. Sum them
over sp (and average over dp) before the optimizer step: `sage_grpo.parallel.fsdp.shard_transformer` sets FSDP2's
gradient divide factor to dp (not dp x sp), and post_train's `sync_gradients` sums over all ranks and divides by dp.

Limits: P must divide the head count (16 for HunyuanVideo-1.5). Dropout must be 0 on the replicated text path
(each rank would drop different activations); LoRA dropout is 0 by default. Collectives run inside each block, so
all sp ranks must run the same forwards and backwards in the same order (also true with gradient checkpointing,
which recomputes a block with its collectives).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sage_grpo.errors import SageGRPOError
from sage_grpo.models.attention import (
    ValidTokenAttnProcessor,
    _attend,
    _dual_stream_blocks,
    encoder_qkv,
    use_valid_token_attention,
    valid_lengths,
)

__all__ = [
    "UlyssesAttnProcessor",
    "enable_sequence_parallel",
    "disable_sequence_parallel",
    "sequence_parallel_enabled",
    "padded_length",
    "shard_tokens",
]


# ---- pure bookkeeping (no process group) ----

def padded_length(n_tokens: int, sp: int) -> int:
    """Smallest multiple of `sp` that holds `n_tokens`."""
    return -(-n_tokens // sp) * sp


def shard_tokens(x: torch.Tensor, sp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s contiguous chunk of `x` along `dim` after zero-padding it to a multiple of `sp`
    ([.., S, ..] -> [.., S_pad / sp, ..]). Concatenating the chunks of all ranks and cutting to S gives `x` back."""
    n = x.shape[dim]
    pad = padded_length(n, sp) - n
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    return x.chunk(sp, dim=dim)[rank]


# ---- collectives with the backward that the "sum over sp" gradient convention needs ----

# torch 2.13 renamed these (the old names warn); torch 2.11 has only the old ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S_loc, H, d] (my tokens, all heads) -> [B, P*S_loc, H/P, d] (all tokens in rank order, my heads)."""
    p = dist.get_world_size(group)
    b, s, h, d = x.shape
    x = x.reshape(b, s, p, h // p, d).permute(2, 1, 0, 3, 4).contiguous()  # [P, S_loc, B, H/P, d]: chunk j -> rank j
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)  # out[j]: rank j's tokens, my heads
    return out.permute(2, 0, 1, 3, 4).reshape(b, p * s, h // p, d)


def _heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """Inverse of `_seq_to_heads`: [B, P*S_loc, H/P, d] -> [B, S_loc, H, d]."""
    p = dist.get_world_size(group)
    b, s_all, h, d = y.shape
    y = y.reshape(b, p, s_all // p, h, d).permute(1, 2, 0, 3, 4).contiguous()  # [P, S_loc, B, H/P, d]: tokens of rank j
    out = torch.empty_like(y)
    dist.all_to_all_single(out, y, group=group)  # out[j]: my tokens, head group j
    return out.permute(2, 1, 0, 3, 4).reshape(b, s_all // p, p * h, d)


class _SeqToHeads(torch.autograd.Function):
    """All-to-all; its adjoint is the inverse all-to-all (a permutation of data, no sums)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(g.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g.contiguous(), ctx.group), None


class _GatherHeads(torch.autograd.Function):
    """Text attention output [B, T, H/P, d] -> [B, T, H, d] on every rank. The replicated text stream downstream
    carries partial gradients (their sum over sp is the true one), so the backward sums them: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        p = dist.get_world_size(group)
        xt = x.permute(2, 0, 1, 3).contiguous()  # [H/P, B, T, d]
        out = xt.new_empty(p * xt.shape[0], *xt.shape[1:])  # [H, B, T, d], head group j from rank j
        _all_gather(out, xt, group=group)
        return out.permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, g):
        p = dist.get_world_size(ctx.group)
        gt = g.permute(2, 0, 1, 3).contiguous()  # [H, B, T, d]
        out = gt.new_empty(gt.shape[0] // p, *gt.shape[1:])  # [H/P, B, T, d]
        _reduce_scatter(out, gt, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.permute(1, 2, 0, 3), None


class _GatherTokens(torch.autograd.Function):
    """Model output [B, S_loc, C] -> [B, P*S_loc, C] on every rank. Every rank holds the same full loss, so the
    output gradient is the same everywhere and the backward keeps my chunk of it (no sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), x.shape[1]
        p = dist.get_world_size(group)
        xt = x.transpose(0, 1).contiguous()  # [S_loc, B, C]
        out = xt.new_empty(p * xt.shape[0], *xt.shape[1:])  # [P*S_loc, B, C]
        _all_gather(out, xt, group=group)
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx, g):
        return g[:, ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


# ---- processor and hooks ----

class _SPState:
    """The sp group of one transformer, and the unpadded video length of its current forward (set by the rope hook,
    read at proj_out; the blocks get it through the rotary tuple so that checkpoint recomputes never read it late).
    A deepcopy of the transformer (e.g. a frozen reference model) shares the process group, not the length."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.n_video = None

    def __deepcopy__(self, memo):
        return _SPState(self.group)


class UlyssesAttnProcessor(ValidTokenAttnProcessor):
    """`ValidTokenAttnProcessor` under Ulysses: local video tokens in, all-to-all to a head split, valid-token
    attention over all video tokens and my heads of the (replicated) text tokens, all-to-all back."""

    def __init__(self, state: _SPState):
        self.state = state

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        if image_rotary_emb is None or len(image_rotary_emb) != 3:
            raise SageGRPOError("UlyssesAttnProcessor runs only inside a transformer set up by "
                                "enable_sequence_parallel")
        cos, sin, n_video = image_rotary_emb  # cos/sin: [S_loc, d], my tokens' rows; n_video: unpadded S
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
        qkv = _SeqToHeads.apply(torch.cat([query, key, value]), st.group)[:, :n_video]
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
        out = _attend(query, key, value, lengths, self._attention_backend).to(query.dtype)  # [B, S + T, H/P, d]
        video = out[:, :n_video]
        pad = s_loc * st.size - n_video
        if pad:  # the pad tokens get zero attention output (they are cut at proj_out)
            video = torch.cat([video, video.new_zeros(batch, pad, *video.shape[2:])], dim=1)
        video = _HeadsToSeq.apply(video, st.group).flatten(2, 3)  # [B, S_loc, H*d]
        # 6: output projections
        video = attn.to_out[1](attn.to_out[0](video))
        if encoder_hidden_states is None:
            return video, None
        text = _GatherHeads.apply(out[:, n_video:], st.group).flatten(2, 3)  # [B, T, H*d], the same on every rank
        return video, attn.to_add_out(text)


class _RopeHook:
    """rope output (cos, sin) [S, d] -> (my rows of cos, of sin, S)."""

    def __init__(self, state):
        self.state = state

    def __call__(self, module, args, output):
        cos, sin = output
        st = self.state
        st.n_video = cos.shape[0]
        return shard_tokens(cos, st.size, st.rank, 0), shard_tokens(sin, st.size, st.rank, 0), cos.shape[0]


class _SplitHook:
    """x_embedder output [B, S, D] -> my zero-padded chunk [B, S_pad / P, D]."""

    def __init__(self, state):
        self.state = state

    def __call__(self, module, args, output):
        return shard_tokens(output, self.state.size, self.state.rank, 1)


class _GatherHook:
    """proj_out output [B, S_pad / P, C] -> [B, S, C], the same on every rank."""

    def __init__(self, state):
        self.state = state

    def __call__(self, module, args, output):
        return _GatherTokens.apply(output, self.state.group)[:, : self.state.n_video]


_HOOK_TYPES = (_RopeHook, _SplitHook, _GatherHook)


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
    blocks = _dual_stream_blocks(transformer)
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
    state = _SPState(sp_group)
    for block in blocks:
        proc = UlyssesAttnProcessor(state)
        proc._attention_backend = block.attn.processor._attention_backend
        block.attn.set_processor(proc)
    transformer.rope.register_forward_hook(_RopeHook(state))
    transformer.x_embedder.register_forward_hook(_SplitHook(state))
    transformer.proj_out.register_forward_hook(_GatherHook(state))
    return transformer


def disable_sequence_parallel(transformer):
    """Back to single-process valid-token attention (every rank computes everything). Returns the transformer."""
    if sequence_parallel_enabled(transformer):
        for block in _dual_stream_blocks(transformer):
            proc = ValidTokenAttnProcessor()
            proc._attention_backend = block.attn.processor._attention_backend
            block.attn.set_processor(proc)
    _remove_hooks(transformer)
    return transformer


def sequence_parallel_enabled(transformer) -> bool:
    return any(isinstance(b.attn.processor, UlyssesAttnProcessor) for b in _dual_stream_blocks(transformer))
