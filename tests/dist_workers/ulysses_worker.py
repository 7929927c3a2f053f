"""torchrun worker for tests/test_ulysses.py: Ulysses (sp = world size) against one process, several cases.

Every rank builds the same seeded model and inputs, runs the reference single-process forward/backward itself and
then the sp one; it writes rank{r}.json with the relative errors (max |a - b| / max |b|) of the output, of the
parameter gradients summed over the sp group and of the input gradients summed over the sp group.
Usage: worker.py OUT_DIR
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import HunyuanVideo15Transformer3DModel

from sage_grpo.errors import SageGRPOError
from sage_grpo.models.attention import use_diffusers_attention, use_valid_token_attention
from sage_grpo.models.lora import setup_trainable
from sage_grpo.models.sequence_parallel import enable_sequence_parallel, sequence_parallel_enabled
from sage_grpo.models.tiny import tiny_transformer_config
from sage_grpo.parallel.dist import init_distributed

TXT, B5, IMG = 24, 8, 4  # MLLM, ByT5 and image token slots
# 4 heads x 16 (rope axes 4 + 6 + 6 = 16), so each of 2 sp ranks holds 2 heads
SMALL = dict(num_attention_heads=4, attention_head_dim=16, rope_axes_dim=(4, 6, 6), num_layers=2)


def build(dtype, lora=False, seed=0, **over):
    torch.manual_seed(seed)
    m = HunyuanVideo15Transformer3DModel(**{**tiny_transformer_config(), **SMALL, **over})
    with torch.no_grad():  # some layers start at zero (proj_out): perturb all so every weight matters
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    use_valid_token_attention(m)
    if lora:  # adapters start with B = 0: perturb them too so that A's gradient is not zero
        setup_trainable(m, use_lora=True, lora_r=4, lora_alpha=8)
        with torch.no_grad():
            for p in m.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.05)
    return m.to(dtype)


def inputs(dtype, video=(3, 4, 6), txt_valid=(17, 3), b5_valid=(5, 1), seed=1):
    """A CFG pair: prompts with different valid MLLM and ByT5 lengths (right padding, as the encoders give)."""
    g = torch.Generator().manual_seed(seed)
    b, cfg = len(txt_valid), tiny_transformer_config()

    def mask(n, valid):
        return torch.stack([torch.arange(n) < v for v in valid]).long()

    return dict(
        hidden_states=torch.randn(b, cfg["in_channels"], *video, generator=g).to(dtype),
        timestep=torch.tensor([700.0, 300.0][:b]).to(dtype),
        encoder_hidden_states=torch.randn(b, TXT, cfg["text_embed_dim"], generator=g).to(dtype),
        encoder_attention_mask=mask(TXT, txt_valid),
        encoder_hidden_states_2=torch.randn(b, B5, cfg["text_embed_2_dim"], generator=g).to(dtype),
        encoder_attention_mask_2=mask(B5, b5_valid),
        image_embeds=torch.zeros(b, IMG, cfg["image_embed_dim"]).to(dtype),
        return_dict=False,
    )


def run(model, inp, weight, group=None):
    """Output, parameter gradients and input gradients (latents, MLLM text) of sum(out * weight); with a group the
    gradients are summed over it (the Ulysses convention)."""
    model.zero_grad(set_to_none=True)
    x = inp["hidden_states"].clone().requires_grad_(True)
    t = inp["encoder_hidden_states"].clone().requires_grad_(True)
    out = model(**{**inp, "hidden_states": x, "encoder_hidden_states": t})[0]
    (out.double() * weight).sum().backward()
    grads = [p.grad.double() if p.grad is not None else torch.zeros_like(p, dtype=torch.float64)
             for p in model.parameters() if p.requires_grad]
    ins = [x.grad.double(), t.grad.double()]
    if group is not None:
        for g in grads + ins:
            dist.all_reduce(g, group=group)
    return out.detach().double(), torch.cat([g.flatten() for g in grads]), ins


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def case(group, dtype, video, checkpointing=False, lora=False, stock_reference=True):
    ref = build(dtype, lora=lora)
    sp = enable_sequence_parallel(copy.deepcopy(ref), group)
    assert sequence_parallel_enabled(sp)
    if stock_reference:  # diffusers' own processor (dense mask) as the single-process truth
        use_diffusers_attention(ref)
    if checkpointing:
        ref.enable_gradient_checkpointing()
        sp.enable_gradient_checkpointing()
    inp = inputs(dtype, video=video)
    w = torch.randn(2, tiny_transformer_config()["out_channels"], *video, generator=torch.Generator().manual_seed(2),
                    dtype=torch.float64)
    o_r, g_r, i_r = run(ref, inp, w)
    o_s, g_s, i_s = run(sp, inp, w, group)
    # every sp rank must return the same full output (rank 0's copy is the yardstick)
    o0 = o_s.clone()
    dist.broadcast(o0, src=dist.get_global_rank(group, 0), group=group)
    return dict(out=rel(o_s, o_r), grad=rel(g_s, g_r), in_latent=rel(i_s[0], i_r[0]), in_text=rel(i_s[1], i_r[1]),
                same_on_ranks=bool(torch.equal(o0, o_s)), n_grads=int(g_r.numel()),
                grad_norm=float(g_r.norm()))


def main(out_dir: str) -> None:
    info = init_distributed(sp_size=int(dist_world()))
    group = info.sp_group
    res = {}
    # 72 video tokens (divisible by 2) and 45 (not): the last rank's chunk is padded
    res["even_fp64"] = case(group, torch.float64, (3, 4, 6))
    res["odd_fp64"] = case(group, torch.float64, (3, 3, 5))
    res["odd_ckpt_fp64"] = case(group, torch.float64, (3, 3, 5), checkpointing=True)
    res["odd_lora_fp64"] = case(group, torch.float64, (3, 3, 5), lora=True)
    res["odd_lora_ckpt_fp32"] = case(group, torch.float32, (3, 3, 5), checkpointing=True, lora=True)
    # a deepcopy of an sp model (a frozen reference policy) runs sp too, on the same group, under no_grad
    with torch.no_grad():
        sp = enable_sequence_parallel(build(torch.float64), group)
        twin = copy.deepcopy(sp)
        inp = inputs(torch.float64, video=(2, 3, 5))
        res["deepcopy_same"] = bool(torch.equal(sp(**inp)[0], twin(**inp)[0])) and sequence_parallel_enabled(twin)
        ref = build(torch.float64)
        res["nograd_out"] = rel(twin(**inp)[0], ref(**inp)[0])
    try:  # 3 heads cannot be split over 2 ranks
        enable_sequence_parallel(build(torch.float64, num_attention_heads=3), group)
        res["heads_error"] = ""
    except SageGRPOError as e:
        res["heads_error"] = str(e)
    Path(out_dir, f"rank{info.rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def dist_world() -> int:
    import os

    return int(os.environ["WORLD_SIZE"])


if __name__ == "__main__":
    main(sys.argv[1])
