#!/usr/bin/env python
"""Generate videos with HunyuanVideo-1.5 (base weights, a training checkpoint, or a LoRA adapter).

    python generate.py --config configs/tiny_cpu.yaml --prompt "a red ball rolls"          # tiny model, CPU, seconds
    python generate.py --model_path ckpts/HunyuanVideo-1.5-Diffusers-480p_t2v --prompt "..." --output_path out.mp4
    python generate.py --checkpoint_path outputs/run/checkpoint-500 \\
        --valid_video_csv prompts.csv --output_path outputs/gen      # one mp4 per prompt in outputs/gen/
    python generate.py --checkpoint_path exported/transformer ...   # a folder written by scripts/export_checkpoint.py
    python generate.py --model_path ckpts/HunyuanVideo-1.5-Diffusers-480p_i2v --prompt "..." --image first.png
    torchrun --nproc_per_node 8 generate.py --valid_video_csv prompts.csv ...   # prompts split across ranks
    torchrun --nproc_per_node 8 generate.py --sp_size 2 ...   # 4 groups of 2 ranks, each group shares one video

The authors' flags keep their meaning; `--config` reads the `model:` and `validation:` sections of our YAML for
everything not given on the command line. A training checkpoint (--checkpoint_path checkpoint-N) brings its run's
settings beneath them: its saved config, so its base model (another one named is refused) and validation settings.
Sampling is the ODE (Euler) of diffusers' pipeline by default; `--sampler`/`--eta` pick a GRPO SDE sampler instead.
Every flag is checked (with the config's rules) and the output folder (writable, none of its videos there unless
--overwrite) and mp4 support are proven before any model loads. Each video `<name>.mp4` gets `<name>.txt` (the exact
prompt, read by scripts/score_videos.py) and `<name>_config.json` (the resolved settings) beside it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import time
from pathlib import Path

from sage_grpo.cli import CLIParser, check_output_file, check_writable_dir, quiet_libraries, show_progress
from sage_grpo.config import ATTENTION_BACKENDS, DTYPES, check_fp8_matmul_flags, parse_bool, parse_size
from sage_grpo.errors import SageGRPOError, run_cli
from sage_grpo.hostmem import free_host_memory_eagerly
from sage_grpo.sde import SAMPLERS

MAX_SEED = 2**63 - 1  # seeds are hashed as signed 64-bit integers
OTHER_EXTENSIONS = {".mkv", ".avi", ".mov", ".webm", ".gif", ".m4v", ".mpg", ".mpeg", ".wmv", ".flv", ".png", ".jpg",
                    ".jpeg", ".txt", ".json", ".csv"}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    from sage_grpo.config import Config

    d = Config()  # the defaults the help shows are the config's (resolve_args fills unset flags from it)
    m, v, r = d.model, d.validation, d.rollout
    p = CLIParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--config", default="", help="our YAML config: its model: and validation: sections fill unset flags")
    a("--prompt", action="append", default=[], help="a prompt (repeatable)")
    a("--image", action="append", default=[], help="reference image of an image-to-video checkpoint for the --prompt "
      "videos (repeatable: one per --prompt in order, or one for all of them); the video's size is the image's "
      "bucket, not --fixed_size. A prompt file gives its images in a ref_image_path column")
    a("--negative_prompt", default=None,
      help=f"negative prompt for CFG (default: rollout.neg_prompt, {r.neg_prompt!r})")
    a("--valid_video_csv", "--prompt_file", dest="prompt_file", default="",
      help="prompt file: .csv (column prompt, optional index/seed/ref_image_path), .txt, .jsonl")
    a("--model_path", default=None,
      help="diffusers-layout directory (default: auto-detect under --pretrained_model_root)")
    a("--pretrained_model_root", default=None, help=f"root of the weights (default: {m.pretrained_model_root})")
    a("--pretrained_transformer_version", default=None,
      help=f"authors' transformer sub-folder (default: {m.pretrained_transformer_version})")
    a("--checkpoint_path", default="", help="trained weights: a training checkpoint (checkpoint-N or "
      "checkpoint-N/transformer, DCP) or a transformer exported by scripts/export_checkpoint.py")
    a("--lora_path", default="", help="LoRA adapter (safetensors file or directory) to apply, in any layout "
      "scripts/export_checkpoint.py --lora_format writes (peft, diffusers, original, comfy; detected from the keys); "
      "its adapter_config.json or the file itself sets r, alpha and the target modules")
    a("--num_inference_steps", type=int, default=None,
      help=f"sampling steps (default: {v.validation_num_inference_steps})")
    a("--video_length", type=int, default=None, help=f"frames, 4k+1 (default: {v.validate_video_length})")
    a("--fixed_size", default=None, help=f"HxW in pixels, multiples of 16 (default: {v.validation_fixed_size})")
    a("--seed", type=int, default=None, help=f"base seed (default: {v.validation_seed}); each video's noise seed "
      "combines it with the prompt text and the prompt file's seed column (or the prompt's row index)")
    a("--output_path", default="outputs/generate",
      help="an .mp4 file (one prompt) or a directory (default: %(default)s)")
    a("--overwrite", action="store_true", help="replace videos already at the output paths (without it, an existing "
      "video is refused before any model loads)")
    a("--dtype", default=None, choices=DTYPES, help=f"weights/compute dtype (default: {m.dtype})")
    a("--sampler", default="ode", choices=SAMPLERS, help="ode (deterministic, default) or a GRPO SDE sampler")
    a("--eta", type=float, default=None,
      help=f"SDE noise level in (0, 1] for --sampler != ode (default: rollout.eta, {r.eta:g})")
    a("--sage_sigma_clamp", type=float, default=None, help="sage_grpo's sigma clamp inside the log, in (0, 1) "
      f"(default: rollout.sage_sigma_clamp, {r.sage_sigma_clamp:g})")
    a("--cfg_scale", type=float, default=None,
      help=f"classifier-free guidance scale >= 1 (default: {v.validation_guidance_scale:g}; 1 = off)")
    a("--flow_shift", type=float, default=None, help=f"schedule shift > 0 (default: {v.validation_timestep_shift:g})")
    a("--fps", type=int, default=None, help=f"mp4 frame rate >= 1 (default: {r.video_fps})")
    a("--text_embedding_cache_dir", default=None, help="on-disk text-embedding cache (default: "
      f"model.text_embedding_cache_dir, {m.text_embedding_cache_dir!r}; empty = in memory)")
    a("--offload_text_encoder", default=None, metavar="BOOL", help="free the text encoders once the prompts are "
      "encoded, before the transformer loads (default: model.offload_text_encoder, "
      f"{str(m.offload_text_encoder).lower()})")
    a("--vae_tiling", default=None, metavar="BOOL", help="decode the videos with the VAE in tiles, as post_train.py "
      f"decodes its validation videos (default: model.vae_tiling, {str(m.vae_tiling).lower()}; no effect below the "
      "tile size; reference images are encoded whole either way)")
    a("--compile", default=None, metavar="BOOL", help="compile each transformer block with torch.compile (default: "
      f"model.compile, {str(m.compile).lower()}; the first video pays the compilation)")
    a("--fp8_base", default=None, metavar="BOOL", help="store the base's transformer-block linear weights in FP8 "
      "(float8_e4m3fn, per-output-channel scales; dequantized as each layer runs), as post_train.py --fp8_base "
      "trains them; a LoRA adapter stays beside them unmerged (default: the run's own setting for a --checkpoint_path "
      f"of a LoRA run, else model.fp8_base, {str(m.fp8_base).lower()})")
    a("--fp8_matmul", default=None, metavar="BOOL", help="with --fp8_base: run its layers as FP8 matrix products "
      "(CUDA compute capability 8.9 or above), as post_train.py --fp8_matmul (default: the run's own setting when "
      f"--fp8_base follows the run, else model.fp8_matmul, {str(m.fp8_matmul).lower()})")
    a("--attention_backend", default=None, choices=ATTENTION_BACKENDS, help="kernel of the transformer's attention "
      f"(default: model.attention_backend, {m.attention_backend}; post_train.py's flag: sage runs here, having no "
      "backward; one this machine cannot run is one line before any model loads)")
    a("--sp_size", type=int, default=1, help="Ulysses sequence-parallel degree under torchrun: each group of sp_size "
      "ranks samples one video at a time (must divide the world size and the 16 heads; default %(default)s; the "
      "prompts are split over the world_size / sp_size groups)")
    a("--verbose", action="store_true", help="show the libraries' warnings and progress bars (hidden by default; "
      "the sampling bar shows on an interactive terminal)")
    return p


def _defaults(config_path: str, run: Path | None):
    """The project's defaults, under the settings of the training run `run` (a checkpoint-N: its saved config, what
    the run's output_dir/config.yaml holds) when --checkpoint_path names one, under the YAML's sections when --config
    is given -> (the config, the keys the YAML sets). cfg.explicit: the keys the run or the YAML set, which the base
    checkpoint's own sampling defaults never replace (_checkpoint_defaults)."""
    from sage_grpo.checkpoint import read_train_state
    from sage_grpo.config import FIELDS, check_values, config_from_dict, read_yaml

    saved = {}
    if run is not None:  # keys of flags a newer version dropped are left out: they set nothing here
        groups = read_train_state(run)["config"].values()
        saved = {k: v for group in groups for k, v in group.items() if k in FIELDS}
    from_yaml = read_yaml(config_path) if config_path else {}  # a missing file is read_yaml's one clear error
    cfg = config_from_dict({**saved, **from_yaml}, config_path or str(run))
    check_values(cfg)
    cfg.explicit = frozenset(saved) | frozenset(from_yaml)
    return cfg, frozenset(from_yaml)


# config key named in sage_grpo.config.check_values' messages -> this script's flag
_FLAG_OF = {
    "validation_num_inference_steps": "num_inference_steps",
    "grpo_sampling_steps": "num_inference_steps",
    "validate_video_length": "video_length",
    "validation_fixed_size": "fixed_size",
    "validation_timestep_shift": "flow_shift",
    "validation_guidance_scale": "cfg_scale",
    "validation_seed": "seed",
    "video_fps": "fps",
    "sde_type": "sampler",
}


def _check_values(args: argparse.Namespace, cfg) -> None:
    """Every sampling flag against the config system's rules (sage_grpo.config.check_values: steps >= 1, frames
    4k + 1, sizes multiples of 16, shift > 0, fps >= 1, cps eta <= 1, the sage_grpo schedule and clamp), plus the
    rules the config has no field for; messages name this script's flags."""
    from sage_grpo.config import check_values

    if args.flow_shift <= 0:  # the config's message names two flags at once
        raise SageGRPOError(f"--flow_shift must be > 0, got {args.flow_shift:g}")
    if args.cfg_scale < 1:
        raise SageGRPOError("--cfg_scale must be >= 1 (1 = no guidance; the pipeline's default is 6), got "
                            f"{args.cfg_scale:g}")
    if args.sampler != "ode" and not 0 < args.eta <= 1:
        raise SageGRPOError(f"--eta must be in (0, 1] for --sampler {args.sampler} (the rollouts use 0.3-0.7; above 1 "
                            f"the first steps inject more noise than the sample holds), got {args.eta:g}")
    if args.sp_size < 1:
        raise SageGRPOError(f"--sp_size must be >= 1, got {args.sp_size}")
    if not -MAX_SEED - 1 <= args.seed <= MAX_SEED:
        raise SageGRPOError(f"--seed must fit in a signed 64-bit integer, got {args.seed}")
    c = copy.deepcopy(cfg)
    v = c.validation
    v.validation_num_inference_steps, v.validate_video_length = args.num_inference_steps, args.video_length
    v.validation_fixed_size, v.validation_timestep_shift = args.fixed_size, args.flow_shift
    v.validation_guidance_scale, v.validation_seed = args.cfg_scale, args.seed
    c.rollout.video_fps = args.fps
    if args.sampler != "ode":  # the rollout rules of the sampler (the YAML's rollout section is checked already)
        r = c.rollout
        r.sde_type, r.eta = args.sampler, args.eta
        r.grpo_sampling_steps, r.flow_shift = args.num_inference_steps, args.flow_shift
        r.sage_sigma_clamp, r.cfg_scale = args.sage_sigma_clamp, args.cfg_scale
    elif not 0.0 < args.sage_sigma_clamp < 1.0:
        raise SageGRPOError(f"--sage_sigma_clamp must be in (0, 1), got {args.sage_sigma_clamp}")
    try:
        check_values(c)
    except SageGRPOError as err:
        message = re.sub(r"--(\w+)", lambda m: "--" + _FLAG_OF.get(m.group(1), m.group(1)), str(err))
        raise SageGRPOError(message) from None


BASE_KEYS = ("model_path", "pretrained_model_root", "pretrained_transformer_version")  # where the base model is


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    from sage_grpo.models.lora import training_checkpoint

    args.run_checkpoint = training_checkpoint(args.checkpoint_path) if args.checkpoint_path else None
    cfg, yaml_keys = _defaults(args.config, args.run_checkpoint)
    m, v, r = cfg.model, cfg.validation, cfg.rollout
    # where the user names the base model: flags, keys of the YAML (else a training checkpoint brings its run's)
    args.base_flags = [f"--{k}" for k in BASE_KEYS if getattr(args, k) is not None]
    in_yaml = [k for k in BASE_KEYS if k in yaml_keys and getattr(args, k) is None]
    if in_yaml:
        args.base_flags.append(f"model.{'/'.join(in_yaml)} of --config {args.config}")
    if args.checkpoint_path and args.run_checkpoint is None and not args.base_flags:
        _take_exported_base(args)
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
        "sage_sigma_clamp": r.sage_sigma_clamp,
        "text_embedding_cache_dir": m.text_embedding_cache_dir,
        "offload_text_encoder": m.offload_text_encoder,
        "vae_tiling": m.vae_tiling,
        "compile": m.compile,
        "attention_backend": m.attention_backend,
    }
    explicit_clamp = args.sage_sigma_clamp is not None
    # set by the user (flag or the YAML's validation key) or the run: the checkpoint's own default never replaces them
    args.explicit = {k for k, key in (("flow_shift", "validation_timestep_shift"),
                                      ("cfg_scale", "validation_guidance_scale"))
                     if getattr(args, k) is not None or key in cfg.explicit}
    args.base_config = cfg
    for k, val in fill.items():
        if getattr(args, k) is None:
            setattr(args, k, val)
    args.offload_text_encoder = parse_bool(args.offload_text_encoder, "--offload_text_encoder")
    args.compile = parse_bool(args.compile, "--compile")
    if args.fp8_base is not None:
        args.fp8_base = parse_bool(args.fp8_base, "--fp8_base")
    if args.fp8_matmul is not None:
        args.fp8_matmul = parse_bool(args.fp8_matmul, "--fp8_matmul")
    args.vae_tiling = parse_bool(args.vae_tiling, "--vae_tiling")
    args.lora = dict(r=m.lora_r, alpha=m.lora_alpha, dropout=m.lora_dropout, targets=list(m.lora_target_modules))
    args.height, args.width = parse_size(args.fixed_size, "--fixed_size")
    if args.compile and args.sp_size > 1:  # the config's rule (sage_grpo.config.validate)
        raise SageGRPOError(f"--compile is not yet verified with --sp_size {args.sp_size}; use --compile False")
    if args.sampler == "ode" and args.eta:
        raise SageGRPOError("--eta applies to SDE samplers; pass --sampler sage_grpo (or another) with it")
    if explicit_clamp and args.sampler != "sage_grpo":
        raise SageGRPOError("--sage_sigma_clamp applies to --sampler sage_grpo only")
    if args.eta is None:  # an SDE sampler at eta 0 would silently be the ODE
        args.eta = 0.0 if args.sampler == "ode" else r.eta
    if args.sampler != "ode" and args.eta <= 0:
        raise SageGRPOError(f"--sampler {args.sampler} needs --eta > 0 (at 0 every SDE sampler is the ODE)")
    _check_values(args, cfg)
    if args.sampler == "sage_grpo":
        from sage_grpo.sde import check_sage_schedule

        check_sage_schedule(args.num_inference_steps, args.flow_shift, args.sage_sigma_clamp)
    return args


def _take_exported_base(args) -> None:
    """An exported transformer (scripts/export_checkpoint.py) with no base named: the base its model card names
    (sage_grpo.models.model_card.card_base), said in one line."""
    from sage_grpo.models.lora import locate_trained_weights
    from sage_grpo.models.model_card import card_base

    try:
        kind, where = locate_trained_weights(args.checkpoint_path)
    except SageGRPOError:
        return  # _check_weights says what it is not
    base = card_base(where) if kind == "diffusers" else {}
    for k, v in base.items():
        setattr(args, k, v)
    if base and os.environ.get("RANK", "0") == "0":
        print(f"[generate] {where}: the base model its README.md names ("
              + ", ".join(f"--{k} {v}" for k, v in base.items()) + ")", flush=True)


def _prompts(args):
    from sage_grpo.data import PromptRecord, read_prompts

    for p in args.prompt:
        if not p.strip():
            raise SageGRPOError("--prompt is empty; give the text to generate")
    images = [str(Path(p).expanduser().resolve()) for p in args.image]
    if images and not args.prompt:
        raise SageGRPOError("--image goes with --prompt (a prompt file gives its images in a ref_image_path column)")
    if len(images) not in (0, 1, len(args.prompt)):
        raise SageGRPOError(f"{len(images)} --image for {len(args.prompt)} --prompt: give one per --prompt, or one "
                            "for all of them")
    if len(images) == 1:
        images = images * len(args.prompt)
    records = [PromptRecord(prompt=p, index=i, ref_image_path=images[i] if images else None)
               for i, p in enumerate(args.prompt)]
    if args.prompt_file:
        from dataclasses import replace

        # file rows come after the --prompt ones, so indices (output names, default seeds) never collide
        records += [replace(r, index=r.index + len(records)) for r in read_prompts(args.prompt_file)]
    if not records:
        raise SageGRPOError("give --prompt \"...\" or --valid_video_csv/--prompt_file FILE")
    seen: dict[int, str] = {}
    for rec in records:
        if rec.index in seen:
            raise SageGRPOError(f"{args.prompt_file}: index {rec.index} is used twice ({seen[rec.index]!r} and "
                                f"{rec.prompt!r}); their videos would overwrite each other")
        seen[rec.index] = rec.prompt
        if rec.seed is not None and not -MAX_SEED - 1 <= rec.seed <= MAX_SEED:
            raise SageGRPOError(f"{args.prompt_file}: seed {rec.seed} of {rec.prompt!r} does not fit in 64 bits")
    return records


def _output_file(args, rec, single: bool) -> Path:
    from sage_grpo.generation import sample_stem

    out = Path(args.output_path)
    if single and out.suffix.lower() == ".mp4":
        return out
    return out / f"{sample_stem(rec)}.mp4"


def _check_outputs(args, records) -> None:
    """The output path names an .mp4 (one prompt) or a folder, is writable and holds none of the videos to write
    (unless --overwrite): proven before any model loads."""
    out = Path(args.output_path)
    suffix = out.suffix.lower()
    if suffix in OTHER_EXTENSIONS and not out.is_dir():
        raise SageGRPOError(f"--output_path {args.output_path!r}: only .mp4 videos are written; give a .mp4 file "
                            "(one prompt) or a folder")
    if suffix == ".mp4":
        if len(records) > 1:
            raise SageGRPOError(f"--output_path {args.output_path!r} is one file but there are {len(records)} "
                                "prompts; give a directory")
        check_output_file(out, "--output_path", create=False)  # made by the first video written
    else:
        check_writable_dir(out, "--output_path", create=False)
    existing = [p for p in (_output_file(args, r, len(records) == 1) for r in records) if p.exists()]
    if existing and not args.overwrite:  # another run's video (e.g. the base model's) is never replaced silently
        if existing[0] == out:
            what = f"--output_path {out} already exists"
        else:
            what = f"--output_path {out}: {existing[0].name}" + (
                f" and {len(existing) - 1} more of these prompts' videos already exist" if len(existing) > 1
                else " already exists")
        raise SageGRPOError(f"{what}; choose another --output_path, or pass --overwrite to replace "
                            f"{'them' if len(existing) > 1 else 'it'}")


def _check_weights(args) -> None:
    """Paths that would otherwise fail only after the base model has loaded."""
    from sage_grpo.models.lora import locate_trained_weights

    for flag, path in (("--checkpoint_path", args.checkpoint_path), ("--lora_path", args.lora_path)):
        if path and not Path(path).exists():
            raise SageGRPOError(f"{flag} {path} does not exist")
    if args.checkpoint_path:
        kind, where = locate_trained_weights(args.checkpoint_path)
        # export_checkpoint.py --merge_lora False: base weights, the adapter beside them; alone they are the base model
        if kind == "diffusers" and (where / "lora").is_dir() and not args.lora_path:
            raise SageGRPOError(f"--checkpoint_path {args.checkpoint_path} holds the base weights of a LoRA run with "
                                f"its adapter unmerged in {where / 'lora'}: add --lora_path {where / 'lora'}")
        if kind == "lora" and args.fp8_base is None:  # the policy the run trained: its base, FP8 or not
            run = json.loads((where.parent / "train_state.json").read_text())["config"]["model"]
            args.fp8_base = bool(run.get("fp8_base", False))
            if args.fp8_matmul is None:
                args.fp8_matmul = args.fp8_base and bool(run.get("fp8_matmul", False))
    if args.fp8_base is None:
        args.fp8_base = args.base_config.model.fp8_base
    if args.fp8_matmul is None:
        args.fp8_matmul = args.fp8_base and args.base_config.model.fp8_matmul
    if args.fp8_base and args.lora_path and args.checkpoint_path and kind == "lora":
        raise SageGRPOError("--fp8_base keeps an adapter unmerged beside the FP8 base, so only one fits: pass the LoRA "
                            "run's --checkpoint_path or --lora_path, or --fp8_base False (the first is merged)")


TASKS = {"t2v": "text-to-video", "i2v": "image-to-video"}


def _describe(loc) -> str:
    return f"{loc.root} ({TASKS[loc.task]}{f', {loc.version}' if loc.layout == 'authors' else ''})"


def _check_run_base(args) -> None:
    """A training checkpoint's weights sample on its run's base model (path, version, task: its saved config, which
    resolve_args made the defaults). A base the user names (flag or --config) must be that one, or, where the run's
    is no longer there (moved), of its task; anything else is one error, before any model loads (weights of
    another model's shape fail again when they load, in one line)."""
    from sage_grpo.checkpoint import read_train_state, run_base
    from sage_grpo.models.loading import locate_model
    from sage_grpo.models.tiny_checkpoint import TINY_CHECKPOINT_DIR

    run = args.run_checkpoint
    if run is None:
        return
    state = read_train_state(run)
    root, path, version = run_base(state)
    try:
        theirs = locate_model(root, path, version)
    except SageGRPOError:
        theirs = None
    if not args.base_flags:  # the run's own base: resolve_args took it from the saved config
        if theirs is None and Path(path) != Path(TINY_CHECKPOINT_DIR):  # the tiny default is built on first use
            raise SageGRPOError(f"--checkpoint_path {args.checkpoint_path}: the base model of its run, "
                                f"{path or root!r} (saved in {run / 'train_state.json'}), is not there or "
                                "incomplete; pass --model_path where it is now")
        if os.environ.get("RANK", "0") == "0":
            print(f"[generate] {run}: its run's settings and base model {path or root}", flush=True)
        return
    try:
        mine = locate_model(args.pretrained_model_root, args.model_path, args.pretrained_transformer_version)
    except SageGRPOError:
        return  # load_pipeline names what is missing
    named = " and ".join(args.base_flags)
    if theirs is None:  # moved: the one thing left to compare is the task
        task = state.get("task")
        if task is not None and task != mine.task:
            raise SageGRPOError(f"--checkpoint_path {args.checkpoint_path} holds {TASKS[task]} weights but {named} "
                                f"names {_describe(mine)}; pass the base model it was trained on ({path or root!r})")
        return
    same = mine.root.resolve() == theirs.root.resolve() and mine.layout == theirs.layout
    if not same or (mine.layout == "authors" and mine.version != theirs.version):
        raise SageGRPOError(f"--checkpoint_path {args.checkpoint_path} was trained on {_describe(theirs)}, not on "
                            f"{_describe(mine)} ({named}); leave out {named} to sample on the run's base model")


def main(argv: list[str] | None = None) -> list[Path]:
    args = resolve_args(build_parser().parse_args(argv))
    records = _prompts(args)
    single = len(records) == 1
    _check_outputs(args, records)
    _check_weights(args)
    _check_run_base(args)
    from sage_grpo.video import check_mp4_support

    check_mp4_support()  # before sampling, not after it
    from sage_grpo.models.image_cond import check_reference_images

    check_reference_images(records, "--image / the prompt file")  # every image decodes, before any model loads
    quiet_libraries(args.verbose)
    free_host_memory_eagerly()  # as post_train.py: every rank's host returns what it frees (sage_grpo.hostmem)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % args.sp_size:
        raise SageGRPOError(f"--sp_size {args.sp_size} must divide the number of processes {world} "
                            f"(torchrun --nproc_per_node x nodes)")

    from sage_grpo.generation import record_noise_seed, sample_videos, write_sample
    from sage_grpo.models.attention import check_attention_backend, set_attention_backend
    from sage_grpo.models.fp8 import check_fp8_matmul, quantize_base
    from sage_grpo.models.loading import (
        attach_transformer,
        load_pipeline,
        load_transformer,
        read_text_encoders,
        resolve_dtype,
    )
    from sage_grpo.models.lora import load_trained_weights, locate_trained_weights, setup_trainable
    from sage_grpo.models.parallelize import parallelize
    from sage_grpo.models.text_cache import TextEmbeddingCache
    from sage_grpo.models.tiny_checkpoint import ensure_tiny_checkpoint
    from sage_grpo.parallel.dist import barrier, destroy, init_distributed
    from sage_grpo.rollout import SamplerSettings, latent_shape

    info = init_distributed(args.sp_size, 1)  # no process group for one process
    rank, device = info.rank, info.device
    dtype = resolve_dtype(args.dtype)
    check_attention_backend(args.attention_backend, device, dtype, training=False)  # before any model loads
    check_fp8_matmul_flags(args.fp8_base, args.fp8_matmul, args.dtype)
    if args.fp8_matmul:
        check_fp8_matmul(device)

    ensure_tiny_checkpoint(args.model_path, is_main=rank == 0, log=lambda msg: print(f"[generate] {msg}", flush=True))
    from sage_grpo.models.image_cond import ImageConditioningCache, check_task
    from sage_grpo.models.loading import locate_model

    source = "--prompt/--image" if args.prompt else args.prompt_file
    try:
        loc = locate_model(args.pretrained_model_root, args.model_path, args.pretrained_transformer_version)
    except SageGRPOError:
        loc = None  # load_pipeline names what is missing
    if loc is not None:
        check_task(loc.task, records, source, "--image")  # the prompts fit the checkpoint's task, before models load
    # the conditioning parts first (the transformer a meta-device stand-in): every prompt and image is encoded and
    # the text encoders freed before the transformer loads, so the 7B encoder and the 8.3B transformer never share
    # memory (post_train.py's order)
    pipe = load_pipeline(args.pretrained_model_root, args.model_path, args.pretrained_transformer_version, dtype=dtype,
                         device=device, load_text_encoders=False, load_transformer=False)
    task = pipe.sage_grpo_task
    _checkpoint_defaults(args, pipe, rank)
    if args.vae_tiling:  # post_train.py's rule, not --fixed_size's: an I2V video takes its image's size
        pipe.vae.enable_tiling()
    try:
        shape = latent_shape(pipe.vae.config, args.video_length, args.height, args.width)
    except ValueError as err:  # a model whose VAE compresses more than the config's 16x rule allows for
        raise SageGRPOError(f"--video_length / --fixed_size do not fit this model: {err}") from None
    settings = SamplerSettings(sde_type=args.sampler, eta=args.eta, num_steps=args.num_inference_steps,
                               shift=args.flow_shift, cfg_scale=args.cfg_scale, compute_dtype=dtype,
                               sage_clamp=args.sage_sigma_clamp)
    cache = TextEmbeddingCache(pipe, device, dtype, args.text_embedding_cache_dir or None,  # encoders: on a miss
                               loader=lambda: read_text_encoders(pipe.sage_grpo_location, dtype))
    mine = records[info.dp_rank::info.dp_size]  # split over data-parallel groups; sp peers share their prompts
    writer = info.sp_rank == 0  # one peer of each sp group writes (all of them hold the same frames)
    cache.precompute([r.prompt for r in mine] + ([args.negative_prompt] if settings.use_cfg else []))
    images = (ImageConditioningCache(pipe, device, dtype, args.text_embedding_cache_dir or None) if task == "i2v"
              else None)
    if images is not None:
        images.precompute([r.ref_image_path for r in mine])  # VAE + SigLIP once per image
    if args.offload_text_encoder:  # every prompt is cached: the encoders are freed (a later miss reloads them)
        cache.release_encoders()
        if images is not None:
            images.offload_encoder()
    transformer = load_transformer(pipe.sage_grpo_location, dtype)
    adapter = args.lora_path
    if args.checkpoint_path:  # full weights first, then an adapter on top of them
        kind, where = locate_trained_weights(args.checkpoint_path)
        if args.fp8_base and kind == "lora":  # unmerged beside the FP8 base: the policy the run trained
            adapter = str(where)
        else:
            load_trained_weights(transformer, args.checkpoint_path)
    if args.fp8_base:  # block by block on the device (post_train.py's order): bf16 blocks never all there
        quantize_base(transformer, device, fp8_matmul=args.fp8_matmul)
    attach_transformer(pipe, transformer.to(device))
    if adapter:
        setup_trainable(pipe.transformer, use_lora=True, lora_r=args.lora["r"], lora_alpha=args.lora["alpha"],
                        lora_target_modules=args.lora["targets"], pretrained_lora_path=adapter)
    pipe.transformer.requires_grad_(False).eval()
    set_attention_backend(pipe.transformer, args.attention_backend)
    # an sp group samples each of its videos together: same prompts and seeds on every peer, so the same inputs
    parallelize(pipe.transformer, info, compile=args.compile)
    written = []
    t0 = time.time()
    for rec, frames in sample_videos(pipe, cache, mine, settings=settings, shape=shape, base_seed=args.seed,
                                     negative_prompt=args.negative_prompt, decode=writer, images=images,
                                     show_progress=rank == 0 and show_progress(args.verbose)):
        path = _output_file(args, rec, single)
        if not writer:
            continue
        meta = {k: v for k, v in vars(args).items() if k not in ("prompt", "explicit", "base_config", "base_flags")}
        meta.update(prompt=rec.prompt, index=rec.index, prompt_seed=rec.seed, task=task, image=rec.ref_image_path,
                    noise_seed=record_noise_seed(rec), frames=int(frames.shape[0]),
                    layout=pipe.sage_grpo_location.layout, weights=str(pipe.sage_grpo_location.root),
                    seconds=round(time.time() - t0, 3), video=str(path))
        write_sample(path, frames, prompt=rec.prompt, fps=args.fps, meta=meta)
        written.append(path)
        print(f"[generate] rank {rank}: {path} ({frames.shape[0]} frames {frames.shape[2]}x{frames.shape[3]}, "
              f"{meta['seconds']} s)", flush=True)
        t0 = time.time()
    barrier()
    destroy()
    return written


def _checkpoint_defaults(args, pipe, rank: int) -> None:
    """--flow_shift / --cfg_scale that the user did not set take the checkpoint's own (its scheduler and guider
    configs: e.g. 7 and 1 for the step-distilled model), checked again like the flags; one the user set and that
    differs from the checkpoint's is kept with a warning (--cfg_scale 1, CFG off, with a note)."""
    import math

    from sage_grpo.models.loading import checkpoint_sampling_defaults

    defaults = checkpoint_sampling_defaults(pipe.sage_grpo_location)
    taken = []
    for flag, key in (("flow_shift", "flow_shift"), ("cfg_scale", "guidance_scale")):
        value, default = getattr(args, flag), defaults[key]
        if math.isclose(value, default):
            continue
        if flag in args.explicit:
            if rank == 0 and flag == "cfg_scale" and value == 1.0:  # CFG off: a recipe, not a carried-over scale
                print(f"[generate] --cfg_scale 1: classifier-free guidance off (the checkpoint's guider config has "
                      f"{default:g})", flush=True)
            elif rank == 0:
                print(f"[generate] warning: --{flag} {value:g} differs from the checkpoint's own default {default:g}; "
                      f"pass --{flag} {default:g} to use it", flush=True)
        else:
            setattr(args, flag, default)
            taken.append(f"--{flag} {default:g}")
    if taken:
        _check_values(args, args.base_config)  # the sampler's rules at the checkpoint's values
        if args.sampler == "sage_grpo":
            from sage_grpo.sde import check_sage_schedule

            check_sage_schedule(args.num_inference_steps, args.flow_shift, args.sage_sigma_clamp)
        if rank == 0:
            print(f"[generate] from the checkpoint's scheduler/guider configs: {', '.join(taken)}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    run_cli(main)
