"""Ulysses sequence parallelism: the pad/split bookkeeping of sage_grpo.parallel.ulysses in one process, and
HunyuanVideo-1.5's plan (sage_grpo.models.sequence_parallel) forward/backward against one process on 2 gloo ranks
(tests/dist_workers/ulysses_worker.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sage_grpo.models.sequence_parallel import enable_sequence_parallel
from sage_grpo.parallel.ulysses import padded_length, shard_tokens

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 5, 8, 45])
def test_shards_are_equal_sized_and_rebuild_the_sequence(sp, n):
    x = torch.randn(2, n, 3, generator=torch.Generator().manual_seed(n))  # [B, S, D]
    shards = [shard_tokens(x, sp, r, dim=1) for r in range(sp)]
    assert padded_length(n, sp) % sp == 0 and 0 <= padded_length(n, sp) - n < sp
    assert all(s.shape == (2, padded_length(n, sp) // sp, 3) for s in shards)
    full = torch.cat(shards, dim=1)  # [B, S_pad, D]
    assert torch.equal(full[:, :n], x) and not full[:, n:].any()  # the pad is zeros, at the end


def test_rotary_rows_follow_their_tokens():
    """Rotary applied per shard with the shard's rows of the table equals rotary on the full sequence, sharded."""
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15RotaryPosEmbed

    rope = HunyuanVideo15RotaryPosEmbed(1, 1, [4, 6, 6])
    cos, sin = rope(torch.zeros(1, 1, 3, 3, 5))  # [45, 16] each
    q = torch.randn(2, 45, 4, 16, generator=torch.Generator().manual_seed(0))  # [B, S, H, d]
    full = apply_rotary_emb(q, (cos, sin), sequence_dim=1)
    for r in range(2):
        local = apply_rotary_emb(shard_tokens(q, 2, r), (shard_tokens(cos, 2, r, 0), shard_tokens(sin, 2, r, 0)),
                                 sequence_dim=1)
        assert torch.allclose(local, shard_tokens(full, 2, r))  # the pad row: zero q -> zero on both sides


def test_one_rank_or_no_group_leaves_the_model_alone():
    sentinel = object()
    assert enable_sequence_parallel(sentinel, None) is sentinel


@pytest.mark.dist
def test_ulysses_matches_one_process_forward_and_backward(tmp_path):
    """sp = 2 on 2 gloo ranks against diffusers' own single-process forward: output, parameter gradients summed over
    the sp group and input gradients (latents, text) summed over it. A CFG pair with different valid MLLM (17, 3)
    and ByT5 (5, 1) lengths; 72 video tokens (divisible by 2) and 45 (padded to 46); gradient checkpointing; peft
    LoRA adapters (their gradients only). fp64: errors are rounding (~1e-15, bound 1e-12); fp32: ~5e-7, bound 5e-6.
    Planted bugs give >= 1e-4 (text gradient not summed over sp), 2e-3 (pad keys attended), 3e-2 (wrong text heads)."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(ROOT / "tests/dist_workers/ulysses_worker.py"), str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for res in ranks:
        for name in ("even_fp64", "odd_fp64", "odd_ckpt_fp64", "odd_lora_fp64", "odd_lora_ckpt_fp32"):
            c, tol = res[name], (1e-12 if "fp64" in name else 5e-6)
            assert c["same_on_ranks"], name
            assert c["grad_norm"] > 1.0, name  # the loss reaches the parameters at all
            for key in ("out", "grad", "in_latent", "in_text"):
                assert c[key] < tol, (name, key, c[key])
        assert res["odd_lora_fp64"]["n_grads"] < res["odd_fp64"]["n_grads"]  # only the adapters train
        assert res["deepcopy_same"] and res["nograd_out"] < 1e-12
        assert res["heads_error"] == "--sp_size 2 must divide the attention head count 3"
