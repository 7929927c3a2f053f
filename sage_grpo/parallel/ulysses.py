"""Ulysses sequence parallelism, model-agnostic: the token split, the collectives with the backward its gradient
convention needs, and the two module hooks that split and gather a sequence.

A model's plan (which module outputs to split and gather, and an attention processor that turns the token split into
a head split around attention) lives with the model: `sage_grpo.models.sequence_parallel` for HunyuanVideo-1.5.
The pieces here:

- `shard_tokens` / `padded_length`: a sequence of S tokens is zero-padded to a multiple of P (the sp size) and rank r
  keeps its contiguous chunk of S_pad / P tokens;
- `seq_to_heads` / `heads_to_seq`: one all-to-all from [B, S_pad/P, H, d] (my tokens, all heads) to
  [B, S_pad, H/P, d] (all tokens, my heads) and back; each is the other's adjoint (a permutation, no sums);
- `gather_heads`: an output replicated on every rank, computed per head group ([B, T, H/P, d] -> [B, T, H, d]);
- `gather_tokens`: the model output, [B, S_pad/P, C] -> [B, S_pad, C] on every rank;
- `ShardTokensHook` / `GatherTokensHook`: forward hooks applying `shard_tokens` to a module's output (recording the
  unpadded length in the shared `SPState`) and `gather_tokens` + the cut back to that length.

GRADIENTS (what the caller must do). Every sp rank computes the same full loss from the same full output; the
gather's backward keeps only the local chunk of the output gradient, so each rank back-propagates its own tokens
(and 1/P of a replicated path through its heads; `gather_heads`' backward sums the replicated path's partial
gradients). After `backward()` each rank's parameter gradients, and the gradients of the inputs, are partial: THE
FULL GRADIENT IS THE SUM OVER THE SP GROUP. Sum them over sp (and average over dp) before the optimizer step:
`sage_grpo.parallel.fsdp.shard_modules` sets FSDP2's gradient divide factor to dp (not dp x sp), and
`sage_grpo.parallel.dist.sync_gradients` sums over all ranks and divides by dp.

Collectives run inside the model's forward, so all sp ranks must run the same forwards and backwards in the same
order (also true with gradient checkpointing, which recomputes a block with its collectives).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "padded_length",
    "shard_tokens",
    "seq_to_heads",
    "heads_to_seq",
    "gather_heads",
    "gather_tokens",
    "SPState",
    "ShardTokensHook",
    "GatherTokensHook",
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
    """[B, T, H/P, d] -> [B, T, H, d] on every rank. The replicated stream downstream carries partial gradients
    (their sum over sp is the true one), so the backward sums them: reduce-scatter."""

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
    """[B, S_loc, C] -> [B, P*S_loc, C] on every rank. Every rank holds the same full loss, so the output gradient
    is the same everywhere and the backward keeps my chunk of it (no sum)."""

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


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S_loc, H, d] (my tokens, all heads) -> [B, P*S_loc, H/P, d] (all tokens in rank order, my heads)."""
    return _SeqToHeads.apply(x, group)


def heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """[B, P*S_loc, H/P, d] -> [B, S_loc, H, d] (inverse of `seq_to_heads`)."""
    return _HeadsToSeq.apply(y, group)


def gather_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, T, H/P, d] (my head group of a replicated sequence) -> [B, T, H, d] on every rank; backward sums."""
    return _GatherHeads.apply(x, group)


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S_loc, C] (my tokens) -> [B, P*S_loc, C] on every rank; backward keeps my chunk."""
    return _GatherTokens.apply(x, group)


# ---- the split and the gather as forward hooks ----

class SPState:
    """The sp group of one model, and the unpadded sequence length of its current forward (recorded by
    `ShardTokensHook`, read by `GatherTokensHook`). A deepcopy of the model (e.g. a frozen reference model) shares
    the process group, not the length."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.n_tokens = None

    def __deepcopy__(self, memo):
        return SPState(self.group)


class ShardTokensHook:
    """Forward hook: output [B, S, D] -> my zero-padded chunk [B, S_pad / P, D]; records S in the state."""

    def __init__(self, state: SPState):
        self.state = state

    def __call__(self, module, args, output):
        self.state.n_tokens = output.shape[1]
        return shard_tokens(output, self.state.size, self.state.rank, 1)


class GatherTokensHook:
    """Forward hook: output [B, S_pad / P, C] -> [B, S, C], the same on every rank."""

    def __init__(self, state: SPState):
        self.state = state

    def __call__(self, module, args, output):
        return gather_tokens(output, self.state.group)[:, : self.state.n_tokens]
