"""Regional compilation of HunyuanVideo-1.5's transformer (`--compile`): each dual-stream block's forward through
`torch.compile(fullgraph=True)`, as diffusers' `compile_repeated_blocks` and torchtitan's per-block compile do, with
one difference that our valid-token attention needs: only the block's `forward` is compiled, not its hooks.

Why the hooks stay outside. The valid lengths of the encoder tokens are data (a mask); reading them needs one host
sync (`.tolist()`), which dynamo cannot trace ("Could not guard on data-dependent expression"). The padding-cut pre-hook
of `sage_grpo.models.attention` reads them once per model forward (cached on the mask tensor that every block
receives), cuts the encoder padding and hands the block the lengths as plain ints in place of the mask. Compiling the
module call (`nn.Module.compile`, which is what `compile_repeated_blocks` does) would pull that hook, and FSDP2's
unshard hooks, into the graph; compiling `forward` leaves them eager, as torchtitan's compiled blocks under FSDP2 do.

Recompilations are bounded, not one per prompt length: the graph is traced with dynamic shapes (`dynamic=True`), so
the text length, the valid lengths and the batch are symbols, and all blocks share one compiled function (the block
is an argument, not a constant), so 54 blocks cost one trace. What still makes a new graph: grad mode (rollout /
anchor / validation under no_grad vs the update), a batch of 1 (dynamo specialises sizes 0 and 1), the order of the
valid lengths in a batch (which samples are padded and which share an attention call: for a CFG pair, the prompt
longer, shorter or as long as the negative prompt), and a different processor or LoRA state (the fixed LoRA anchor
disables the adapters): 8 graphs for batches of 1 and 2 in both grad modes (tests/test_compile.py), well under
RECOMPILE_LIMIT.

One difference from eager: the last block's text-stream output is discarded by the model, so eager autograd leaves
the gradients of that block's `to_add_out` and `ff_context` None, while the compiled backward returns zeros for them.
The outputs and every other gradient are the same (tests/test_compile.py); those parameters never affect an output,
but with zeros instead of None the optimizer steps them (weight decay shrinks them a little each update).

`compile_blocks` is idempotent, survives `copy.deepcopy` (the anchor copy runs compiled too) and is undone by
`uncompile_blocks`. Apply it before FSDP2's `fully_shard` (sage_grpo.models.parallelize does), as torchtitan does.
"""

from __future__ import annotations

import functools

import torch

from sage_grpo.models.attention import dual_stream_blocks

__all__ = ["compile_blocks", "uncompile_blocks", "blocks_compiled"]

_MARK = "_sage_grpo_compiled"
RECOMPILE_LIMIT = 32
DEFAULT_BACKEND = "inductor"


@functools.cache
def _compiled_forward(cls: type, backend, mode: str | None):
    """One compiled function per block class and options: the block is its first argument, so every block (and
    every copy of a block) reuses the same graphs."""

    def block_forward(block, *args, **kwargs):
        return cls.forward(block, *args, **kwargs)

    return torch.compile(block_forward, fullgraph=True, dynamic=True, backend=backend, mode=mode)


def _plain(x):
    """x itself when it is a contiguous tensor of its own, else a contiguous copy."""
    if isinstance(x, torch.Tensor) and (x._base is not None or not x.is_contiguous()):
        return x.clone(memory_format=torch.contiguous_format)
    return x


def _call(fn, block, *args, **kwargs):
    """The block's forward: its tensor inputs as plain contiguous tensors, then the compiled function. The first block
    gets views (the patch embedding's transposed output, the encoder tokens cut by the padding hook; under sequence
    parallelism a slice), every later block the previous block's fresh outputs; dynamo guards on a view's base and
    strides, so without the copy the first block would need graphs of its own. The copy is made once per model
    forward (the first block), a no-op for the others."""
    return fn(block, *(_plain(a) for a in args), **kwargs)


def compile_blocks(transformer, *, backend=None, mode: str | None = None):
    """Run every dual-stream block's forward through one `torch.compile(fullgraph=True, dynamic=True)` function.
    backend / mode: torch.compile's; backend None = DEFAULT_BACKEND (tests pass a counting backend, and
    `scripts/gpu_check.py --tiny` dynamo's "eager" backend to stay quick on a CPU). Returns the transformer."""
    backend = backend or DEFAULT_BACKEND
    # A safety margin over dynamo's per-function graph limit (8): the graphs a run needs are counted in the module
    # docstring and tested, but with fullgraph a run that hit the limit would stop with an error.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for block in dual_stream_blocks(transformer):
        fn = _compiled_forward(type(block), backend, mode)
        # an instance attribute that nn.Module.__call__ picks up in place of the class's forward; functools.partial
        # deep-copies its bound block, so copy.deepcopy(transformer) gives blocks that call their own copy
        block.forward = functools.partial(_call, fn, block)
        setattr(block, _MARK, True)
    return transformer


def uncompile_blocks(transformer):
    """Back to the eager forward. Returns the transformer."""
    for block in dual_stream_blocks(transformer):
        if getattr(block, _MARK, False):
            del block.forward
            delattr(block, _MARK)
    return transformer


def blocks_compiled(transformer) -> bool:
    return all(getattr(b, _MARK, False) for b in dual_stream_blocks(transformer))
