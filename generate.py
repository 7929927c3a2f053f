#!/usr/bin/env python
"""Generate videos with HunyuanVideo-1.5 (base weights, a training checkpoint, or a LoRA adapter).

    python generate.py --config configs/tiny_cpu.yaml --prompt "a red ball rolls"          # tiny model, CPU, seconds
    python generate.py --model_path ckpts/HunyuanVideo-1.5-Diffusers-480p_t2v --prompt "..." --output_path out.mp4
    python generate.py --pretrained_model_root ckpts --checkpoint_path outputs/checkpoint-500/transformer \\
        --valid_video_csv prompts.csv --output_path outputs/gen      # one mp4 per prompt in outputs/gen/
    torchrun --nproc_per_node 8 generate.py --valid_video_csv prompts.csv ...   # prompts split across ranks

The authors' flags keep their meaning; `--config` reads the `model:` and `validation:` sections of our YAML for
everything not given on the command line. Sampling is the ODE (Euler) of diffusers' pipeline by default;
`--sampler`/`--eta` pick a GRPO SDE sampler instead. Each video gets `<name>_config.json` next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from sage_grpo.config import DTYPES
from sage_grpo.errors import SageGRPOError, run_cli
from sage_grpo.sde import SAMPLERS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--config", default="", help="our YAML config: its model: and validation: sections fill unset flags")
    a("--prompt", action="append", default=[], help="a prompt (repeatable)")
    a("--negative_prompt", default=None, help="negative prompt for CFG (default: empty, or rollout.neg_prompt)")
    a("--valid_video_csv", "--prompt_file", dest="prompt_file", default="", help="prompt file: .csv (column prompt, optional index/seed), .txt, .jsonl")
    a("--model_path", default=None, help="diffusers-layout directory (default: auto-detect under --pretrained_model_root)")
    a("--pretrained_model_root", default=None, help="root of the weights (default: ckpts)")
    a("--pretrained_transformer_version", default=None, help="authors' transformer sub-folder (default: 480p_t2v)")
    a("--checkpoint_path", default="", help="a training checkpoint: checkpoint-N/transformer (DCP)")
    a("--lora_path", default="", help="LoRA adapter (safetensors file or directory) to apply; its saved "
      "adapter_config.json sets r, alpha and the target modules")
    a("--num_inference_steps", type=int, default=None, help="sampling steps (default: 40)")
    a("--video_length", type=int, default=None, help="frames, 4k+1 (default: 81)")
    a("--fixed_size", default=None, help="HxW in pixels (default: 480x864)")
    a("--seed", type=int, default=None, help="base seed (default: 930); each video's noise seed combines it with the "
      "prompt file's seed column (or the prompt's row index)")
    a("--output_path", default="outputs/generate", help="an .mp4 file (one prompt) or a directory")
    a("--dtype", default=None, choices=DTYPES, help="weights/compute dtype (default: bf16)")
    a("--sampler", default="ode", choices=SAMPLERS, help="ode (deterministic, default) or a GRPO SDE sampler")
    a("--eta", type=float, default=None, help="SDE noise level for --sampler != ode (default: rollout eta, 0.5)")
    a("--cfg_scale", type=float, default=None, help="classifier-free guidance scale (default: 6.0; 1 = off)")
    a("--flow_shift", type=float, default=None, help="schedule shift (default: 5.0)")
    a("--fps", type=int, default=None, help="mp4 frame rate (default: 24)")
    return p


def _defaults(config_path: str):
    """The project's defaults, overridden by the YAML's sections when --config is given."""
    from sage_grpo.config import Config, load_config

    if not config_path:
        return Config()
    return load_config(["--config", config_path])  # a missing file is load_config's one clear error


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    cfg = _defaults(args.config)
    m, v, r = cfg.model, cfg.validation, cfg.rollout
    fill = {
        "model_path": m.model_path,
        "pretrained_model_root": m.pretrained_model_root,
        "pretrained_transformer_version": m.pretrained_transformer_version,
        "num_inference_steps": v.validation_num_inference_steps,
        "video_length": v.validate_video_length,
        "fixed_size": v.validation_fixed_size,
        "seed": v.validation_seed,
        "dtype": m.dtype,
        "cfg_scale": v.validation_guidance_scale,
        "flow_shift": v.validation_timestep_shift,
        "fps": r.video_fps,
        "negative_prompt": r.neg_prompt,
    }
    for k, val in fill.items():
        if getattr(args, k) is None:
            setattr(args, k, val)
    args.lora = dict(r=m.lora_r, alpha=m.lora_alpha, dropout=m.lora_dropout, targets=list(m.lora_target_modules))
    args.text_embedding_cache_dir = m.text_embedding_cache_dir
    args.offload_text_encoder = m.offload_text_encoder
    match = re.fullmatch(r"(\d+)[xX](\d+)", str(args.fixed_size))
    if not match:
        raise SageGRPOError(f"--fixed_size must be HxW, e.g. 480x864, got {args.fixed_size!r}")
    args.height, args.width = int(match.group(1)), int(match.group(2))
    if args.sampler == "ode" and args.eta:
        raise SageGRPOError("--eta applies to SDE samplers; pass --sampler sage_grpo (or another) with it")
    if args.eta is None:  # an SDE sampler at eta 0 would silently be the ODE
        args.eta = 0.0 if args.sampler == "ode" else r.eta
    if args.sampler != "ode" and args.eta <= 0:
        raise SageGRPOError(f"--sampler {args.sampler} needs --eta > 0 (at 0 every SDE sampler is the ODE)")
    if args.sampler == "sage_grpo":
        from sage_grpo.schedule import sigma_schedule
        from sage_grpo.sde import SAGE_SIGMA_CLAMP

        if float(sigma_schedule(args.num_inference_steps, args.flow_shift)[1]) >= SAGE_SIGMA_CLAMP:
            raise SageGRPOError(
                f"--sampler sage_grpo with {args.num_inference_steps} steps and shift {args.flow_shift}: the first "
                "step would carry no noise (sigma_1 above the 1 - 3e-3 clamp); use fewer steps or a smaller shift"
            )
    return args


def _slug(text: str, n: int = 48) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:n] or "video"


def _prompts(args):
    from sage_grpo.data import PromptRecord, read_prompts

    records = [PromptRecord(prompt=p, index=i) for i, p in enumerate(args.prompt)]
    if args.prompt_file:
        from dataclasses import replace

        # file rows come after the --prompt ones, so indices (output names, default seeds) never collide
        records += [replace(r, index=r.index + len(records)) for r in read_prompts(args.prompt_file)]
    if not records:
        raise SageGRPOError("give --prompt \"...\" or --valid_video_csv/--prompt_file FILE")
    if len(records) > 1 and Path(args.output_path).suffix == ".mp4":
        raise SageGRPOError(f"--output_path {args.output_path!r} is one file but there are {len(records)} prompts; "
                            "give a directory")
    return records


def _output_file(args, rec, single: bool) -> Path:
    out = Path(args.output_path)
    if single and out.suffix == ".mp4":
        return out
    return out / f"{rec.index:04d}_{_slug(rec.prompt)}.mp4"


def _ensure_model(args) -> None:
    """The tiny default model is built on first use (seconds); real weights are never fetched here."""
    from sage_grpo.models.tiny_checkpoint import TINY_CHECKPOINT_DIR, write_tiny_checkpoint

    target = args.model_path or ""
    if target and Path(target) == Path(TINY_CHECKPOINT_DIR) and not (Path(target) / "model_index.json").exists():
        print(f"[generate] building the tiny random model at {target} (scripts/make_tiny_checkpoint.py)", flush=True)
        write_tiny_checkpoint(target)


def main(argv: list[str] | None = None) -> list[Path]:
    args = resolve_args(build_parser().parse_args(argv))
    records = _prompts(args)
    single = len(records) == 1

    import torch
    import torch.distributed as dist

    from sage_grpo.models.loading import load_pipeline, resolve_dtype
    from sage_grpo.models.lora import load_dcp_transformer, setup_trainable
    from sage_grpo.models.text_cache import TextEmbeddingCache
    from sage_grpo.rollout import SamplerSettings, decode_latents, latent_shape, rollout
    from sage_grpo.video import write_video

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL init, so its barrier does not land on GPU 0 for every rank
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dtype = resolve_dtype(args.dtype)

    if rank == 0:  # one writer; _ensure_model only builds the tiny default and never raises
        _ensure_model(args)
    if world > 1:
        dist.barrier()
    pipe = load_pipeline(args.pretrained_model_root, args.model_path, args.pretrained_transformer_version, dtype=dtype, device=device)
    if args.checkpoint_path:  # full weights first, then an adapter on top of them
        load_dcp_transformer(pipe.transformer, args.checkpoint_path)
    if args.lora_path:
        setup_trainable(pipe.transformer, use_lora=True, lora_r=args.lora["r"], lora_alpha=args.lora["alpha"],
                        lora_target_modules=args.lora["targets"], pretrained_lora_path=args.lora_path)
    pipe.transformer.requires_grad_(False).eval()
    if args.height * args.width > 256 * 256:
        pipe.vae.enable_tiling()

    shape = latent_shape(pipe.vae.config, args.video_length, args.height, args.width)
    settings = SamplerSettings(sde_type=args.sampler, eta=args.eta, num_steps=args.num_inference_steps,
                               shift=args.flow_shift, cfg_scale=args.cfg_scale, compute_dtype=dtype)
    cache = TextEmbeddingCache(pipe, device, dtype, args.text_embedding_cache_dir or None)
    mine = records[rank::world]
    cache.precompute([r.prompt for r in mine] + ([args.negative_prompt] if settings.use_cfg else []))
    if args.offload_text_encoder:  # every prompt is cached: the encoders need no device memory while sampling
        cache.offload_encoders()
    written = []
    for rec in mine:
        t0 = time.time()
        cond = cache.get([rec.prompt])
        uncond = cache.get([args.negative_prompt]) if settings.use_cfg else None
        prompt_seed = rec.seed if rec.seed is not None else rec.index
        traj = rollout(pipe.transformer, cond, uncond, prompts=[rec.prompt], prompt_ids=torch.tensor([rec.index]),
                       generation_ids=torch.zeros(1, dtype=torch.long), prompt_seeds=torch.tensor([prompt_seed]),
                       latent_shape=shape, settings=settings, image_tokens=pipe.vision_num_semantic_tokens,
                       base_seed=args.seed, show_progress=rank == 0)
        frames = decode_latents(pipe.vae, traj.final_latents)[0]  # [F, 3, H, W] in [0, 1]
        path = write_video(_output_file(args, rec, single), frames, fps=args.fps)
        meta = {k: v for k, v in vars(args).items() if k not in ("prompt",)}
        meta.update(prompt=rec.prompt, index=rec.index, prompt_seed=prompt_seed, frames=int(frames.shape[0]),
                    layout=pipe.sage_grpo_location.layout, weights=str(pipe.sage_grpo_location.root),
                    seconds=round(time.time() - t0, 3), video=str(path))
        path.with_name(path.stem + "_config.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
        written.append(path)
        print(f"[generate] rank {rank}: {path} ({frames.shape[0]} frames {args.height}x{args.width}, {meta['seconds']} s)", flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return written


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    run_cli(main)
