"""Per-block cost of diffusers' HunyuanVideo-1.5 attention (dense [B,1,S,S] mask) vs sage_grpo's valid-token attention.

GPU (default when CUDA is there): real width (16 heads x 128 = 2048) and the real rollout size (81 frames 352x624 ->
latent 21x22x39 = 18,018 video tokens; 1,000 MLLM + 256 ByT5 + 729 image token slots, of which --mllm_valid and
--byt5_valid are valid; image tokens are all padding for t2v), bf16. Batch 1 (the conditional prompt) and 2 (a CFG
pair with different valid lengths). Medians over --reps, as ratios ours / diffusers':
  attn        the attention module alone (projections, QK-norm, rotary, attention, output projections)
  block       one whole transformer block (ours includes the hook that cuts the encoder padding)
  block_ckpt  forward+backward of the block under gradient checkpointing (what training runs)
Alternatives measured for the CFG pair (attention call only): one packed `varlen_attn` call, and SDPA with a
[B,1,1,S] key-padding mask. A correctness check compares ours with diffusers' processor on the device first
(fp32 outputs and gradients, and the bf16 block outputs at the measured size).

With --backends (comma list of --attention_backend names), the valid-token block on the CFG pair once per attention
backend of diffusers' dispatcher: forward and forward+backward with checkpointing (median ms), TFLOP/s of the
model FLOPs (sage_grpo.flops: the forward's, and forward + backward of full fine-tuning; the recomputation is not
counted) and the output's largest difference from native's. A backend this machine cannot run is listed with the
reason; one without a backward (sage) is timed forward only.

    python scripts/bench_attention.py                 # GPU, writes $OUT/bench_attention.json when OUT is set
    python scripts/bench_attention.py --cpu           # small CPU sanity mode (a few seconds)
    python scripts/bench_attention.py --backends _native_flash,_native_cudnn,_native_efficient,flash,_flash_3,flex
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sage_grpo.models import attention as A  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="small CPU sanity mode (overrides sizes, fp32)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--latent", default="21,22,39", help="latent frames,height,width (patch 1 -> video tokens)")
    p.add_argument("--mllm", type=int, default=1000)
    p.add_argument("--byt5", type=int, default=256)
    p.add_argument("--image", type=int, default=729)
    p.add_argument("--mllm_valid", default="200,5", help="valid MLLM tokens: prompt, negative prompt")
    p.add_argument("--byt5_valid", default="8,8")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="directory for bench_attention.json")
    p.add_argument("--backends", default="", help="comma list of attention backends (--attention_backend names) to "
                   "measure one after another on the valid-token block; native, the reference, is always measured")
    a = p.parse_args(argv)
    if a.cpu:
        a.heads, a.head_dim, a.latent, a.mllm, a.byt5, a.image = 4, 32, "3,8,12", 100, 32, 64
        a.mllm_valid, a.byt5_valid, a.dtype, a.reps = "20,3", "2,1", "fp32", 5
    return a


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, dev, reps, warmup=2):
    for _ in range(warmup):
        fn()
    sync(dev)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t)
    return 1000 * statistics.median(ts)


def peak_gib(fn, dev):
    if dev.type != "cuda":
        return float("nan")
    sync(dev)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync(dev)
    return (torch.cuda.max_memory_allocated() - base) / 2**30


# ---- alternatives to the per-run SDPA calls of sage_grpo.models.attention.prefix_attention ----
def attend_varlen(query, key, value, lengths, backend):
    """One packed variable-length flash call (CUDA, bf16/fp16); 7 positional arguments work on torch 2.11 and 2.13."""
    from torch.nn.attention.varlen import varlen_attn

    b, s = query.shape[:2]
    if any(n < s for n in lengths):
        pack = lambda x: torch.cat([x[i, :n] for i, n in enumerate(lengths)])  # noqa: E731
    else:
        pack = lambda x: x.flatten(0, 1)  # noqa: E731
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=query.device)
    o = varlen_attn(pack(query), pack(key), pack(value), cu, cu, max(lengths), max(lengths))
    outs = [torch.cat([x, x.new_zeros(s - n, *x.shape[1:])]) if n < s else x
            for x, n in zip(torch.split(o, list(lengths)), lengths)]
    return torch.stack(outs)


def attend_keymask(query, key, value, lengths, backend):
    """SDPA with a [B,1,1,S] key-padding mask (memory-efficient kernel; padded query rows are left as computed)."""
    s = query.shape[1]
    keep = torch.arange(s, device=query.device)[None] < torch.tensor(lengths, device=query.device)[:, None]
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None]).transpose(1, 2)


def build(args, dev, dtype):
    from diffusers.models.transformers.transformer_hunyuan_video15 import (
        HunyuanVideo15RotaryPosEmbed,
        HunyuanVideo15TransformerBlock,
    )

    torch.manual_seed(0)
    block = HunyuanVideo15TransformerBlock(args.heads, args.head_dim, mlp_ratio=4.0, qk_norm="rms_norm")
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    block = block.to(dev, dtype)
    f, h, w = (int(x) for x in args.latent.split(","))
    d = args.heads * args.head_dim
    axes = [args.head_dim // 8, args.head_dim * 7 // 16, args.head_dim - args.head_dim // 8 - args.head_dim * 7 // 16]
    freqs = HunyuanVideo15RotaryPosEmbed(1, 1, axes)(torch.empty(1, 1, f, h, w, device=dev))
    return block, freqs, f * h * w, d


def inputs(args, batch, n_video, d, dev, dtype, gen):
    """Block inputs in the layout diffusers' forward hands the blocks: each sample's valid encoder tokens first."""
    s_enc = args.mllm + args.byt5 + args.image
    mv = [int(x) for x in args.mllm_valid.split(",")][:batch]
    bv = [int(x) for x in args.byt5_valid.split(",")][:batch]
    valid = [m + b for m, b in zip(mv, bv)]
    x = torch.randn(batch, n_video, d, device=dev, generator=gen).to(dtype)
    enc = torch.randn(batch, s_enc, d, device=dev, generator=gen).to(dtype)
    mask = torch.arange(s_enc, device=dev)[None] < torch.tensor(valid, device=dev)[:, None]
    temb = torch.randn(batch, d, device=dev, generator=gen).to(dtype)
    return x, enc, temb, mask, valid


def check_fp32(dev):
    """Ours vs diffusers' processor on the device: a 2-block tiny model, fp32, CFG pair of different lengths."""
    from diffusers import HunyuanVideo15Transformer3DModel

    cfg = dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=32, num_layers=2,
               num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=32, text_embed_2_dim=16, image_embed_dim=16,
               rope_axes_dim=(4, 14, 14), target_size=64, task_type="t2v")  # sage_grpo.models.tiny's, 2 blocks
    torch.manual_seed(0)
    stock = HunyuanVideo15Transformer3DModel(**cfg)
    with torch.no_grad():
        for p in stock.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    stock = stock.to(dev)
    ours = A.use_valid_token_attention(copy.deepcopy(stock))
    g = torch.Generator(device=dev).manual_seed(1)
    n = 24
    kw = dict(
        timestep=torch.tensor([700.0, 300.0], device=dev),
        encoder_hidden_states=torch.randn(2, n, cfg["text_embed_dim"], device=dev, generator=g),
        encoder_attention_mask=(torch.arange(n, device=dev)[None] < torch.tensor([[17], [3]], device=dev)).long(),
        encoder_hidden_states_2=torch.randn(2, 8, cfg["text_embed_2_dim"], device=dev, generator=g),
        encoder_attention_mask_2=(torch.arange(8, device=dev)[None] < torch.tensor([[5], [1]], device=dev)).long(),
        image_embeds=torch.zeros(2, 4, cfg["image_embed_dim"], device=dev),
        return_dict=False,
    )
    x = torch.randn(2, cfg["in_channels"], 3, 8, 12, device=dev, generator=g)
    res = []
    for m in (stock, ours):
        out = m(hidden_states=x, **kw)[0]
        out.square().mean().backward()
        res.append((out.detach(), {k: p.grad for k, p in m.named_parameters() if p.grad is not None}))
    (o_s, g_s), (o_o, g_o) = res
    gmax = max(float(g.abs().max()) for g in g_s.values())
    return {
        "fp32_out_max_rel_diff": float((o_o - o_s).abs().max() / o_s.abs().max()),
        "fp32_grad_max_rel_diff": max(float((g_o.get(k, torch.zeros_like(v)) - v).abs().max())
                                      for k, v in g_s.items()) / gmax,
    }


ATTEND = A.prefix_attention


def use(block, kind, variant=None):
    A.prefix_attention = {"varlen": attend_varlen, "keymask": attend_keymask}.get(variant, ATTEND)
    (A.use_valid_token_attention if kind == "ours" else A.use_diffusers_attention)(_Holder(block))


def measure_batch(args, batch, block, freqs, n_video, d, dev, dtype, gen, res):
    """Rows of timings for one batch size: diffusers' processor first, then ours (and the alternatives)."""
    rows = []
    x, enc, temb, mask, valid = inputs(args, batch, n_video, d, dev, dtype, gen)
    n_cut = max(valid)
    with torch.no_grad():
        nx, nenc = block.norm1(x, emb=temb)[0], block.norm1_context(enc, emb=temb)[0]
    gvid = torch.randn_like(x)

    def attn_fwd(full=True):
        with torch.no_grad():
            return block.attn(nx, nenc if full else nenc[:, :n_cut], attention_mask=mask, image_rotary_emb=freqs)

    def attn_fb(full=True):
        a = nx.detach().requires_grad_(True)
        e = (nenc if full else nenc[:, :n_cut]).detach().requires_grad_(True)
        out = block.attn(a, e, attention_mask=mask, image_rotary_emb=freqs)[0]
        out.backward(gvid)
        block.zero_grad(set_to_none=True)

    def block_fwd():
        with torch.no_grad():
            return block(x, enc, temb, mask, freqs)

    def block_fb(ckpt=False):
        xi = x.detach().requires_grad_(True)
        if ckpt:
            out = torch.utils.checkpoint.checkpoint(block, xi, enc, temb, mask, freqs, use_reentrant=False)[0]
        else:
            out = block(xi, enc, temb, mask, freqs)[0]
        out.backward(gvid)
        block.zero_grad(set_to_none=True)

    cases = {"attn": (attn_fwd, attn_fb), "block": (block_fwd, block_fb), "block_ckpt": (None, lambda: block_fb(True))}
    use(block, "diffusers")
    ref_out = block_fwd()[0].float()
    base = {name: (median_ms(f, dev, args.reps) if f else None, median_ms(fb, dev, max(3, args.reps // 2)),
                   peak_gib(fb, dev))
            for name, (f, fb) in cases.items()}
    use(block, "ours")
    out = block_fwd()[0].float()
    res[f"b{batch}_block_out_max_abs_diff"] = float((out - ref_out).abs().max())
    res[f"b{batch}_block_out_mean_abs"] = float(ref_out.abs().mean())
    cases["attn_cut"] = (lambda: attn_fwd(False), lambda: attn_fb(False))
    cuda_pair = dev.type == "cuda" and batch == 2
    variants = [("ours", None)] + ([("varlen", "varlen"), ("keymask", "keymask")] if cuda_pair else [])
    for label, variant in variants:
        use(block, "ours", variant)
        for name, (f, fb) in cases.items():
            if variant and name not in ("attn_cut", "block"):
                continue
            ref = base["attn" if name == "attn_cut" else name]
            fwd = median_ms(f, dev, args.reps) if f else None
            fwdbwd = median_ms(fb, dev, max(3, args.reps // 2))
            rows.append(dict(batch=batch, part=name, impl=label, diffusers_fwd_ms=ref[0], ours_fwd_ms=fwd,
                             fwd_ratio=fwd / ref[0] if fwd and ref[0] else None, diffusers_fwdbwd_ms=ref[1],
                             ours_fwdbwd_ms=fwdbwd, fwdbwd_ratio=fwdbwd / ref[1], diffusers_peak_gib=ref[2],
                             ours_peak_gib=peak_gib(fb, dev), valid=valid))
            print(json.dumps(rows[-1]), flush=True)
    use(block, "diffusers")
    return rows


def main(argv=None):
    args = parse(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    res = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "args": vars(args), "check": check_fp32(dev)}
    print(json.dumps(res["check"]), flush=True)
    block, freqs, n_video, d = build(args, dev, dtype)
    res["video_tokens"], res["encoder_slots"] = n_video, args.mllm + args.byt5 + args.image
    stock_proc = block.attn.processor
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for batch in (1, 2):
        rows += measure_batch(args, batch, block, freqs, n_video, d, dev, dtype, gen, res)
    if args.backends:
        res["backends"] = measure_backends(args, block, freqs, n_video, d, dev, dtype, gen)
    block.attn.set_processor(stock_proc)
    res["rows"] = rows
    print({k: v for k, v in res.items() if k.endswith(("diff", "abs"))})
    print(f"{'batch':>5} {'part':>10} {'impl':>8} {'fwd ms diffusers/ours':>22} {'ratio':>6} {'fwd+bwd ms':>18} "
          f"{'ratio':>6}"
          f" {'peak GiB':>12}")
    for r in rows:
        fwd = f"{r['diffusers_fwd_ms']:.2f}/{r['ours_fwd_ms']:.2f}" if r["ours_fwd_ms"] else "-"
        ratio = f"{r['fwd_ratio']:.2f}" if r["fwd_ratio"] else "-"
        fb = f"{r['diffusers_fwdbwd_ms']:.2f}/{r['ours_fwdbwd_ms']:.2f}"
        mem = f"{r['diffusers_peak_gib']:.2f}/{r['ours_peak_gib']:.2f}"
        print(f"{r['batch']:>5} {r['part']:>10} {r['impl']:>8} {fwd:>22} {ratio:>6} {fb:>18} {r['fwdbwd_ratio']:>6.2f} "
              f"{mem:>12}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_attention.json").write_text(json.dumps(res, indent=1))
    return res


def measure_backends(args, block, freqs, n_video, d, dev, dtype, gen) -> list[dict]:
    """The valid-token block on the CFG pair under each of --backends (native first: the reference) -> one row each."""
    from sage_grpo.flops import TransformerShape, block_flops

    x, enc, temb, mask, valid = inputs(args, 2, n_video, d, dev, dtype, gen)
    shape = TransformerShape(hidden=d, blocks=1)
    fwd_flop = sum(block_flops(n_video, v, shape)[0] for v in valid)
    train_flop = sum(sum(block_flops(n_video, v, shape, train="full")) for v in valid)
    gvid = torch.randn_like(x)

    def fwd():
        with torch.no_grad():
            return block(x, enc, temb, mask, freqs)

    def fwdbwd():
        xi = x.detach().requires_grad_(True)
        torch.utils.checkpoint.checkpoint(block, xi, enc, temb, mask, freqs, use_reentrant=False)[0].backward(gvid)
        block.zero_grad(set_to_none=True)

    use(block, "ours")
    holder = _Holder(block)
    names = ["native"] + [n.strip() for n in args.backends.split(",") if n.strip() and n.strip() != "native"]
    rows, ref = [], None
    for name in names:
        reason = A.probe_attention_backend(name, dev, dtype, training=True)
        forward_only = reason is not None and reason.startswith("has no backward")
        if reason is not None and not forward_only:
            rows.append({"backend": name, "runs": False, "reason": reason})
            print(json.dumps(rows[-1]), flush=True)
            continue
        A.set_attention_backend(holder, name)
        out = fwd()[0].float()
        ref = out if ref is None else ref
        f_ms = median_ms(fwd, dev, args.reps)
        fb_ms = None if forward_only else median_ms(fwdbwd, dev, max(3, args.reps // 2))
        rows.append({"backend": name, "runs": True, "reason": reason, "forward_ms": f_ms, "fwdbwd_ckpt_ms": fb_ms,
                     "forward_tflops": fwd_flop / f_ms / 1e9,
                     "fwdbwd_tflops": train_flop / fb_ms / 1e9 if fb_ms else None,
                     "out_max_abs_diff_vs_native": float((out - ref).abs().max()), "valid": valid})
        print(json.dumps(rows[-1]), flush=True)
    A.set_attention_backend(holder, "auto")
    use(block, "diffusers")
    print(f"{'backend':>18} {'fwd ms':>9} {'TFLOP/s':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8} {'max |out - native|':>19}")
    for r in rows:
        if not r["runs"]:
            print(f"{r['backend']:>18}  cannot run here: {r['reason']}")
            continue
        fb = ("-", "-") if r["fwdbwd_ckpt_ms"] is None else (f"{r['fwdbwd_ckpt_ms']:.2f}", f"{r['fwdbwd_tflops']:.3g}")
        print(f"{r['backend']:>18} {r['forward_ms']:>9.2f} {r['forward_tflops']:>8.3g} {fb[0]:>11} {fb[1]:>8} "
              f"{r['out_max_abs_diff_vs_native']:>19.3g}")
    return rows


class _Holder:
    """Lets use_valid_token_attention / use_diffusers_attention act on a single block."""

    def __init__(self, block):
        self.transformer_blocks = [block]


if __name__ == "__main__":
    main()
