"""Measure what scripts/plan_memory.py predicts: per-block activations of HunyuanVideo-1.5 and the VAE decode.

On the GPU machine (no weights needed, random init; writes $OUT/measure_memory.json, or --out):

    python scripts/measure_memory.py                 # real width (16 x 128), real rollout size 352x624x81
    python scripts/measure_memory.py --frames 121 --height 480 --width 848

For each attention processor (the project's valid-token one and diffusers' dense-mask one), forward batch 1 and 2
(one video, one CFG pair) and gradient checkpointing off / on, it measures one transformer block two ways:
- saved-tensor bytes: `torch.autograd.graph.saved_tensors_hooks` over a forward of a 2-block and a 1-block model,
  counting each storage once and no parameter (the difference is one block); this is what the planner models;
- CUDA peak: max_memory_allocated over the weights of a forward + backward of 4-block and 2-block models, halved
  (the method of ../shared/tools/gpu_probe.py, which gpu_facts.md reports; with checkpointing this difference is
  max(one block's gradient, its saved inputs), see sage_grpo.memory.validate_against_gpu_facts);
and prints the planner's prediction beside each. Then the VAE decode of one latent with and without tiling (peak over
the weights). `--device cpu --small` runs the same code at reduced width and size (the CPU test of this script).
Figures are per rank for sp = 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

GIB = 2**30


def block_config(heads: int, head_dim: int, num_layers: int, mlp_ratio: float = 4.0, *, real: bool = True) -> dict:
    """A transformer config: the 480p_t2v one with `heads` x `head_dim` and `num_layers` blocks (real text widths when
    `real`, else small embedders so that a reduced-width model builds in milliseconds)."""
    from sage_grpo.memory import transformer_config

    cfg = transformer_config("480p_t2v")
    axes_t = head_dim // 8
    axes = (axes_t, (head_dim - axes_t) // 2, head_dim - axes_t - (head_dim - axes_t) // 2)
    cfg.update(num_attention_heads=heads, attention_head_dim=head_dim, num_layers=num_layers, mlp_ratio=mlp_ratio,
               rope_axes_dim=axes)
    if not real:
        cfg.update(in_channels=9, out_channels=4, num_refiner_layers=1, text_embed_dim=32, text_embed_2_dim=16,
                   image_embed_dim=16, target_size=64)
    return cfg


def make_inputs(cfg: dict, batch: int, latent: tuple[int, int, int], text: tuple[int, int, int],
                valid: tuple[int, int], dtype: torch.dtype, device) -> dict:
    """Random transformer inputs: latent (F, H, W); text = (MLLM, ByT5, image) lengths; valid = (MLLM, ByT5) valid
    tokens per sample (image tokens are all padding, as in t2v)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    pm = torch.zeros(batch, text[0], device=device, dtype=dtype)
    pm[:, : valid[0]] = 1
    bm = torch.zeros(batch, text[1], device=device, dtype=dtype)
    bm[:, : valid[1]] = 1
    return dict(hidden_states=r(batch, cfg["in_channels"], *latent),
                timestep=torch.full((batch,), 500.0, device=device, dtype=dtype),
                encoder_hidden_states=r(batch, text[0], cfg["text_embed_dim"]), encoder_attention_mask=pm,
                encoder_hidden_states_2=r(batch, text[1], cfg["text_embed_2_dim"]), encoder_attention_mask_2=bm,
                image_embeds=torch.zeros(batch, text[2], cfg["image_embed_dim"], device=device, dtype=dtype),
                return_dict=False)


def build(cfg: dict, attention: str, checkpointing: bool, dtype: torch.dtype, device):
    from sage_grpo.memory import build_transformer
    from sage_grpo.models.attention import use_valid_token_attention

    torch.manual_seed(0)
    m = build_transformer(cfg, "cpu").to(device, dtype)
    if attention == "valid":
        use_valid_token_attention(m)
    if checkpointing:
        m.enable_gradient_checkpointing()
    return m


def saved_bytes(model, inputs: dict) -> int:
    """Bytes autograd saves for backward in one forward: each storage once, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs)
    return sum(seen.values())


_MODELS: dict = {}


def block_saved_bytes(heads: int, head_dim: int, *, mlp_ratio: float = 4.0, batch: int, latent, text, valid,
                      attention: str = "valid", checkpointing: bool = False, dtype=torch.float32, device="cpu",
                      real: bool = False) -> int:
    """Saved-tensor bytes of one block: saved_bytes(2 blocks) - saved_bytes(the same model cut to its first block).
    The 2-block model is built once per width / processor / dtype and reused."""
    key = (heads, head_dim, mlp_ratio, attention, dtype, str(device), real)
    if key not in _MODELS:
        _MODELS.clear()  # one model alive at a time (real width on the GPU)
        _MODELS[key] = build(block_config(heads, head_dim, 2, mlp_ratio, real=real), attention, False, dtype, device)
    m = _MODELS[key]
    if checkpointing:
        m.enable_gradient_checkpointing()
    else:
        m.disable_gradient_checkpointing()
    kw = make_inputs(dict(m.config), batch, latent, text, valid, dtype, device)
    blocks = m.transformer_blocks
    two = saved_bytes(m, kw)
    m.transformer_blocks = torch.nn.ModuleList(list(blocks)[:1])
    try:
        one = saved_bytes(m, kw)
    finally:
        m.transformer_blocks = blocks
    return two - one


def predicted_block_bytes(heads: int, head_dim: int, *, mlp_ratio: float = 4.0, batch: int, latent, text, valid,
                          attention: str = "valid", checkpointing: bool = False, dtype=torch.float32,
                          device="cpu") -> int:
    """The planner's model (sage_grpo.memory) for the same geometry (the valid processor sees the valid MLLM + ByT5
    tokens)."""
    from sage_grpo.memory import block_activation_bytes

    f, h, w = latent
    text_tokens = sum(valid) if attention == "valid" else sum(text)
    elem = torch.tensor([], dtype=dtype).element_size()
    return block_activation_bytes(batch=batch, video_tokens=f * h * w, text_tokens=text_tokens, dim=heads * head_dim,
                                  heads=heads, mlp_dim=int(heads * head_dim * mlp_ratio), elem=elem,
                                  attention=attention, checkpointing=checkpointing,
                                  ln_stat_bytes=4 if torch.device(device).type == "cuda" else elem)


def cuda_block_peak(heads, head_dim, *, batch, latent, text, valid, attention, checkpointing, dtype) -> float:
    """gpu_probe's method: (peak(4 blocks) - peak(2 blocks)) / 2 over the weights, forward + backward, in GiB."""
    peaks = []
    for n in (2, 4):
        cfg = block_config(heads, head_dim, n)
        m = build(cfg, attention, checkpointing, dtype, "cuda")
        kw = make_inputs(cfg, batch, latent, text, valid, dtype, "cuda")
        for _ in range(2):  # warm-up, then measure
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            m(**kw)[0].float().pow(2).mean().backward()
            m.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del m, kw
        torch.cuda.empty_cache()
    return (peaks[1] - peaks[0]) / 2 / GIB


def vae_decode_peak(latent_channels: int, latent, dtype, device, small: bool) -> dict:
    from diffusers import AutoencoderKLHunyuanVideo15

    if small:
        from sage_grpo.models.tiny import tiny_vae_config

        vae = AutoencoderKLHunyuanVideo15(**tiny_vae_config())
        latent_channels = vae.config.latent_channels
    else:
        vae = AutoencoderKLHunyuanVideo15()
    vae = vae.to(device, dtype).eval()
    z = torch.randn(1, latent_channels, *latent, device=device, dtype=dtype)
    out = {}
    for tiling in (False, True):
        if tiling:
            vae.enable_tiling()
        try:
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t = time.perf_counter()
            with torch.no_grad():
                vae.decode(z, return_dict=False)
            row = {"s": time.perf_counter() - t}
            if device == "cuda":
                torch.cuda.synchronize()
                row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
            out[f"tiling_{'on' if tiling else 'off'}"] = row
        except Exception as e:  # an OOM without tiling is a result too
            out[f"tiling_{'on' if tiling else 'off'}"] = {"error": repr(e)[:300]}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="Reduced width and size (CPU check of this script).")
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--height", type=int, default=352)
    ap.add_argument("--width", type=int, default=624)
    ap.add_argument("--valid_text", type=int, default=200, help="Valid MLLM tokens of the prompt (ByT5: 8).")
    ap.add_argument("--skip_vae", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "measure_memory.json"))
    args = ap.parse_args(argv)
    dev = args.device
    if args.small:
        heads, head_dim, latent, text, valid, dtype = 2, 64, (2, 8, 16), (48, 16, 8), (20, 4), torch.bfloat16
    else:
        heads, head_dim, dtype = 16, 128, torch.bfloat16
        latent = ((args.frames - 1) // 4 + 1, args.height // 16, args.width // 16)
        text, valid = (1000, 256, 729), (args.valid_text, 8)
    res: dict = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__,
                 "latent": latent, "heads": heads, "head_dim": head_dim, "text": text, "valid": valid, "blocks": []}
    for attention in ("valid", "diffusers"):
        for batch in (1, 2):
            for ck in (False, True):
                kw = dict(batch=batch, latent=latent, text=text, valid=valid, attention=attention, checkpointing=ck,
                          dtype=dtype)
                row = {"attention": attention, "batch": batch, "checkpointing": ck}
                try:
                    row["saved_gib"] = block_saved_bytes(heads, head_dim, device=dev, real=not args.small, **kw) / GIB
                    row["predicted_gib"] = predicted_block_bytes(heads, head_dim, device=dev, **kw) / GIB
                    row["ratio"] = row["predicted_gib"] / row["saved_gib"] if row["saved_gib"] else None
                    if dev == "cuda" and not args.small:
                        row["cuda_peak_diff_gib"] = cuda_block_peak(heads, head_dim, **kw)
                except Exception as e:
                    row["error"] = repr(e)[:300]
                res["blocks"].append(row)
                print(json.dumps(row), flush=True)
    if not args.skip_vae:
        res["vae_decode"] = vae_decode_peak(32, latent, dtype, dev, args.small)
        print(json.dumps(res["vae_decode"]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
