"""Attention over the valid tokens only for diffusers' HunyuanVideo-1.5 transformer (no dense mask).

diffusers' `HunyuanVideo15Transformer3DModel.forward` reorders each sample's encoder tokens as [valid image, valid
ByT5, valid MLLM, padding] and hands every block a [B, S_enc] mask, from which its processor builds a dense
[B, 1, S, S] mask (S = video + 729 image + 256 ByT5 + 1000 MLLM tokens) and runs a masked SDPA kernel. A sample's
valid tokens are therefore a prefix of length `S_video + n_i` of the joint sequence, and the padded encoder tokens
never reach a video token (they are masked as keys in every block). Two changes use that, with the same video
outputs and gradients:

1. `ValidTokenAttnProcessor` (every dual-stream block's `attn`): the same projections, QK-norm and rotary code as
   diffusers' processor, then mask-free attention on each sample's valid prefix. Samples with equal lengths share
   one call (a GRPO group, or every sample once the hook below has cut the padding); a CFG batch whose prompts have
   different lengths runs one call per run of equal lengths. Padded rows get zeros (what SDPA gives a fully
   masked row). The call goes through diffusers' `dispatch_attention_fn`, so `set_attention_backend` still applies;
   with no mask the native backend picks flash attention on the GPU.
2. A forward pre-hook on every block cuts the encoder tokens to the longest valid length of the batch, so the
   projections, norms and feed-forward skip the padding too (the encoder outputs of the last block are discarded
   by the model, so nothing visible changes). It is a no-op while a block runs any other processor.

The valid lengths come from the mask with one host sync per forward: they are cached on the mask tensor, which the
forward passes unchanged to every block (also through non-reentrant gradient checkpointing; a detached copy
just recomputes them). The block pre-hook reads them and hands the block plain ints in place of the mask, so the
block's forward itself never syncs: `--compile` (sage_grpo.models.compile) compiles that forward with fullgraph.

Measured on an H100 at the rollout size, bf16, CFG pair of different lengths (scripts/bench_attention.py), whole
block forward / forward+backward as a fraction of diffusers': one flash call per length run 0.39 / 0.50; one packed
`torch.nn.attention.varlen.varlen_attn` call 0.49 / 0.66 (the packing copies cost more than a second launch, and it
is CUDA-only); SDPA with a [B,1,1,S] key-padding mask (memory-efficient kernel) 0.46 / 0.64.
"""

from __future__ import annotations

import warnings

import torch

from sage_grpo.config import ATTENTION_BACKENDS
from sage_grpo.errors import SageGRPOError

__all__ = [
    "ValidTokenAttnProcessor",
    "use_valid_token_attention",
    "use_diffusers_attention",
    "valid_token_attention_enabled",
    "valid_lengths",
    "prefix_attention",
    "encoder_qkv",
    "dual_stream_blocks",
    "ATTENTION_BACKENDS",
    "set_attention_backend",
    "attention_backend_of",
    "probe_attention_backend",
    "check_attention_backend",
]

_LENGTHS_ATTR = "_sage_grpo_valid_lengths"
_HOOK_FLAG = "_sage_grpo_valid_token_hook"


def valid_lengths(mask: torch.Tensor | tuple[int, ...] | None, batch: int, n_tokens: int) -> tuple[int, ...]:
    """Per-sample count of valid encoder tokens (a valid prefix, as diffusers' forward orders them), at most
    `n_tokens`. Cached on `mask`: one host sync per forward, not one per block. A tuple is the lengths already (what
    the padding-cut hook hands the block in place of the mask)."""
    if mask is None:
        return (n_tokens,) * batch
    if isinstance(mask, tuple):  # the padding-cut hook's ints: read from a mask of at most n_tokens already
        return mask
    cached = getattr(mask, _LENGTHS_ATTR, None)
    if cached is None:
        m = mask.bool()
        both = torch.stack([m.sum(1), m.long().cumprod(1).sum(1)]).tolist()  # one sync for both
        if both[0] != both[1]:
            raise SageGRPOError(
                "valid-token attention needs each sample's valid encoder tokens first (as HunyuanVideo-1.5's forward "
                "orders them); got a mask with padding between valid tokens"
            )
        cached = tuple(int(n) for n in both[0])
        setattr(mask, _LENGTHS_ATTR, cached)
    return tuple(min(n, n_tokens) for n in cached)


def prefix_attention(query, key, value, lengths, backend):
    """Attention of each sample over its first lengths[i] tokens ([B, S, H, D] in and out; zeros beyond)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    def call(q, k, v):
        return dispatch_attention_fn(q, k, v, dropout_p=0.0, is_causal=False, backend=backend)

    batch, seq = query.shape[:2]
    if all(n == seq for n in lengths):
        return call(query, key, value)
    outs, start = [], 0
    while start < batch:  # runs of equal length share one call (slices: no copies)
        n, end = lengths[start], start + 1
        while end < batch and lengths[end] == n:
            end += 1
        o = call(query[start:end, :n], key[start:end, :n], value[start:end, :n])
        if n < seq:
            o = torch.cat([o, o.new_zeros(end - start, seq - n, *o.shape[2:])], dim=1)
        outs.append(o)
        start = end
    return torch.cat(outs, dim=0)


def encoder_qkv(attn, encoder_hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The encoder tokens' query, key, value [B, T, H, d] with their QK-norm, as diffusers' processor makes them."""
    eq = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
    ek = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
    ev = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
    if attn.norm_added_q is not None:
        eq = attn.norm_added_q(eq)
    if attn.norm_added_k is not None:
        ek = attn.norm_added_k(ek)
    return eq, ek, ev


class ValidTokenAttnProcessor:
    """diffusers' `HunyuanVideo15AttnProcessor2_0` without the dense mask: attends over valid tokens only."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        if self._parallel_config is not None:
            raise SageGRPOError("ValidTokenAttnProcessor does not run under diffusers' context parallelism")
        from diffusers.models.embeddings import apply_rotary_emb

        # 1-3: projections, QK-norm and rotary on the video tokens (as diffusers' processor)
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        n_video = hidden_states.shape[1]
        n_enc = 0
        # 4: encoder tokens
        if encoder_hidden_states is not None:
            n_enc = encoder_hidden_states.shape[1]
            encoder_query, encoder_key, encoder_value = encoder_qkv(attn, encoder_hidden_states)
            query = torch.cat([query, encoder_query], dim=1)
            key = torch.cat([key, encoder_key], dim=1)
            value = torch.cat([value, encoder_value], dim=1)
        # 5: attention on each sample's valid prefix
        lengths = [n_video + n for n in valid_lengths(attention_mask, query.shape[0], n_enc)]
        out = prefix_attention(query, key, value, lengths, self._attention_backend)
        out = out.flatten(2, 3).to(query.dtype)
        # 6: output projections
        if encoder_hidden_states is not None:
            out, encoder_out = out[:, :n_video], out[:, n_video:]
            if getattr(attn, "to_out", None) is not None:
                out = attn.to_out[1](attn.to_out[0](out))
            if getattr(attn, "to_add_out", None) is not None:
                encoder_out = attn.to_add_out(encoder_out)
            return out, encoder_out
        return out, encoder_hidden_states


def _cut_padding_hook(block, args, kwargs):
    """Block pre-hook: cut the encoder tokens (args[1]) to the longest valid length of the batch and replace the mask
    (args[3]) by the valid lengths as ints. The hook runs eagerly outside the block's forward, so a compiled forward
    (sage_grpo.models.compile) receives ints it can trace instead of a mask it would have to sync on."""
    if not isinstance(getattr(block.attn, "processor", None), ValidTokenAttnProcessor):
        return None
    args, kwargs = list(args), dict(kwargs)

    def get(i, name):
        return args[i] if len(args) > i else kwargs.get(name)

    def put(i, name, value):
        if len(args) > i:
            args[i] = value
        else:
            kwargs[name] = value

    enc, mask = get(1, "encoder_hidden_states"), get(3, "attention_mask")
    if enc is None or mask is None:
        return None
    lengths = valid_lengths(mask, enc.shape[0], enc.shape[1])
    keep = max(lengths)
    if keep < enc.shape[1]:
        put(1, "encoder_hidden_states", enc[:, :keep])
    put(3, "attention_mask", lengths)
    return tuple(args), kwargs


def dual_stream_blocks(transformer):
    """The dual-stream blocks (`transformer_blocks`), or an error naming what the model is instead."""
    blocks = getattr(transformer, "transformer_blocks", None)
    if blocks is None or not all(hasattr(b, "attn") and hasattr(b.attn, "add_q_proj") for b in blocks):
        raise SageGRPOError(
            f"valid-token attention expects a HunyuanVideo15Transformer3DModel, got {type(transformer).__name__}"
        )
    return blocks


def use_valid_token_attention(transformer):
    """Attend over valid tokens only in every dual-stream block (processor + padding cut). Idempotent; survives
    `copy.deepcopy`; undone by `use_diffusers_attention`. Returns the transformer.

    A block whose processor already attends over valid tokens keeps it: the sequence-parallel subclass
    (`sage_grpo.models.sequence_parallel`) works with hooks outside the blocks, and `load_pipeline` calls this on a
    transformer that `sage_grpo.models.parallelize.parallelize` may have set up for sequence parallelism already."""
    for block in dual_stream_blocks(transformer):
        if not isinstance(block.attn.processor, ValidTokenAttnProcessor):
            backend = getattr(block.attn.processor, "_attention_backend", None)
            proc = ValidTokenAttnProcessor()
            proc._attention_backend = backend
            block.attn.set_processor(proc)
        if not getattr(block, _HOOK_FLAG, False):
            block.register_forward_pre_hook(_cut_padding_hook, with_kwargs=True)
            setattr(block, _HOOK_FLAG, True)
    return transformer


def use_diffusers_attention(transformer):
    """Back to diffusers' own processor (dense mask); the padding-cut hook then does nothing."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    for block in dual_stream_blocks(transformer):
        backend = getattr(block.attn.processor, "_attention_backend", None)
        proc = HunyuanVideo15AttnProcessor2_0()
        proc._attention_backend = backend
        block.attn.set_processor(proc)
    return transformer


def valid_token_attention_enabled(transformer) -> bool:
    return all(isinstance(b.attn.processor, ValidTokenAttnProcessor) for b in dual_stream_blocks(transformer))




def set_attention_backend(transformer, name: str):
    """Every dual-stream block's valid-token (or Ulysses) processor calls diffusers' dispatcher with backend `name`
    ("auto": None, the dispatcher's active backend). Only this transformer: diffusers' own `set_attention_backend`
    also changes the process-wide active backend. Returns the transformer."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    backend = None if name == "auto" else AttentionBackendName(name)
    for block in dual_stream_blocks(transformer):
        block.attn.processor._attention_backend = backend
    return transformer


def attention_backend_of(transformer) -> str:
    """The backend name `set_attention_backend` gave the transformer ("auto" when none)."""
    backend = dual_stream_blocks(transformer)[0].attn.processor._attention_backend
    return "auto" if backend is None else getattr(backend, "value", str(backend))


def probe_attention_backend(name: str, device, dtype: torch.dtype, training: bool) -> str | None:
    """Why this machine cannot run backend `name` (None: it can): its package is missing, or one attention call
    [1, 16 tokens, 2 heads, 128] in `dtype` on `device` fails, or (training) its backward does. A Hub backend
    downloads its kernel here, as diffusers' set_attention_backend would."""
    if name == "auto":
        return None
    from diffusers.models import attention_dispatch as dispatch
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _check_attention_backend_requirements,
        _maybe_download_kernel_for_backend,
    )

    try:
        backend = AttentionBackendName(name)
    except ValueError:
        return "not a backend of the installed diffusers"
    try:
        _check_attention_backend_requirements(backend)
        if name.endswith("_hub"):
            _maybe_download_kernel_for_backend(backend)
    except Exception as err:  # noqa: BLE001 - diffusers raises RuntimeError / ImportError / hub errors alike
        return f"not installed ({str(err).splitlines()[0]})"
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 128, generator=g).to(device, dtype).requires_grad_(training) for _ in range(3))
    try:
        with warnings.catch_warnings():  # flex attention warns that it is not compiled: true of any probe
            warnings.simplefilter("ignore")
            out = dispatch.dispatch_attention_fn(q, k, v, backend=backend)
    except Exception as err:  # noqa: BLE001 - each backend fails in its own words on a device or dtype it lacks
        return f"does not run on {torch.device(device).type} in {dtype} ({type(err).__name__})"
    if training:
        try:
            out.float().sum().backward()
        except Exception:  # noqa: BLE001
            return "has no backward (inference only: generate.py)"
    return None


def check_attention_backend(name: str, device, dtype: torch.dtype, *, training: bool, flag: str = "--attention_backend"
                            ) -> None:
    """One line (SageGRPOError) when this machine cannot run backend `name`, naming the ones it can (Hub backends,
    which would download kernels, are not probed for that list). Call it before any model loads."""
    reason = probe_attention_backend(name, device, dtype, training)
    if reason is None:
        return
    can = ["auto"] + [b for b in ATTENTION_BACKENDS[1:] if not b.endswith("_hub") and b != name
                      and probe_attention_backend(b, device, dtype, training) is None]
    what = "training" if training else "generation"
    raise SageGRPOError(f"{flag} {name} cannot run {what} here: {reason}; this machine runs: {', '.join(can)}")
