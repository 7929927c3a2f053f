#!/usr/bin/env python
"""SAGE-GRPO post-training of HunyuanVideo-1.5.

One step: every data-parallel rank takes batch_size videos of the step's prompt groups (G rollouts per prompt, a
group may span ranks) and samples them with the SDE sampler (T steps, CFG), storing x_0..x_T and each step's
log-prob; the VAE decodes them, the reward scores them (failures masked), the rewards of all ranks give
group-relative advantages; the anchor's means are computed for the trained (sample, step) pairs unless the anchor
equals the rollout policy; then the shared GRPO update (sage_grpo/grpo.py) re-scores each pair with grad, weights the
clipped surrogate by the equalizer S_t, adds lambda_KL (beta_pos KL_pos + beta_vel KL_vel) and backpropagates.
Gradients of `gradient_accumulation_steps` rounds make one optimizer update (Muon + AdamW, warm-up, grad clip);
the KL coefficient adapts once per update from the rank-averaged L_KL; the anchor is refreshed every
`update_ref_model_step` updates. Validation samples ODE videos and scores them with the reward and held-out metrics
(`sage_grpo/heldout.py`), warning once per metric that falls while the reward rises (`sage_grpo/hacking.py`);
checkpoints resume exactly.

    python post_train.py --config configs/tiny_cpu.yaml                          # tiny model, one CPU process
    torchrun --nproc_per_node 8 post_train.py --config configs/single_node_8gpu.yaml   # FSDP2 + Ulysses sp 2
    bash run_post_train.sh                                                       # the same, with AUTO_RESUME=1
    NNODES=8 NODE_RANK=... MASTER_ADDR=... bash run_post_train_multinode.sh     # 64 GPUs, c10d rendezvous
"""
# The file reads in run order: the two state objects (`Components`, built once; `TrainState`, everything a resume
# restores), `setup`, `train` (which owns the accumulate-then-step decision), the phases in the order `train` calls
# them, checkpoints, `main`. (The docstring above is `--help`'s description.)

from __future__ import annotations

import math
import signal
import sys
import threading
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from sage_grpo.config import Config, config_to_dict, dump_yaml, load_config, parse_size, torch_dtype, validate
from sage_grpo.errors import SageGRPOError, run_cli

if TYPE_CHECKING:
    from sage_grpo.anchor import Anchor
    from sage_grpo.data import GroupSampler, PromptRecord
    from sage_grpo.grpo import PairBatch, UpdateStats
    from sage_grpo.heldout import HeldOut
    from sage_grpo.kl import AdaptiveKLController
    from sage_grpo.models.image_cond import ImageConditioningCache
    from sage_grpo.models.text_cache import TextEmbeddingCache
    from sage_grpo.optim import Optimizers
    from sage_grpo.parallel.dist import DistInfo
    from sage_grpo.rewards.base import Reward
    from sage_grpo.rewards.overlap import EarlyScores
    from sage_grpo.rollout import SamplerSettings, Trajectory


def print0(info: DistInfo, *args) -> None:
    if info.is_main:
        print("[post_train]", *args, flush=True)


# ------------------------------------------------------------------------------------------------------ state


@dataclass(frozen=True)
class Components:
    """What `setup` builds once and the phases use; never reassigned during a run (the anchor's weights and the
    optimizer's state change in place; their bookkeeping is in `TrainState`)."""

    cfg: Config
    info: DistInfo
    out: Path  # --output_dir
    pipe: object  # HunyuanVideo15Pipeline (VAE for decoding, text encoders behind `cache`)
    transformer: torch.nn.Module  # the policy (FSDP2-sharded and/or Ulysses-wrapped when asked)
    trainable: list  # [Parameter]: what the optimizer updates and `sync_gradients` reduces
    optimizer: Optimizers
    anchor: Anchor
    reward: Reward
    cache: TextEmbeddingCache
    prompts: list  # [PromptRecord] training prompts
    val_records: list  # [PromptRecord] validation prompts
    settings: SamplerSettings  # the rollout's SDE sampler
    val_settings: SamplerSettings  # validation's ODE sampler
    shape: tuple  # (C, F, H, W) rollout latent (I2V: of the bucket with the most prompts; a step takes its own)
    val_shape: tuple  # (C, F, H, W) validation latent
    windows: torch.Tensor  # [P, T] bool: the SDE steps of each position of the SDE window (P = 1 unless sliding)
    step_weights: torch.Tensor  # [P, T] equalizer S_t normalised over each window's steps (ones without
    # --use_grad_balancing)
    variance: torch.Tensor  # [T] V_t of the rollout sampler
    heldout: HeldOut  # the held-out metrics validation reports (--validation_metrics)
    images: ImageConditioningCache | None = None  # each reference image's conditioning (I2V checkpoint); None: T2V


@dataclass
class TrainState:
    """Everything a resume restores, saved and loaded as one thing (train_state.json; DCP's `Stateful` protocol:
    `state_dict` / `load_state_dict`). Every field is saved: a plain value as it is, an object through its own
    `state_dict`. The per-rank RNG (dropout) is written beside it, one file per rank, by `checkpoint.save_checkpoint`.

    step: rollout rounds done. updates: optimizer updates done. accum_rounds, pending_kl_sum, pending_kl_pairs: the
    rounds accumulated into the pending update and their L_KL sum and valid pair count on this rank (the controller
    moves with their mean when the update is taken; the accumulated gradient is the mean over the pairs so far; the
    checkpoint keeps every data-parallel rank's pair, `pending_kl_by_dp_rank`, since rank 0 writes this state).
    anchor_synced: the anchor equals the current policy (initial, or just refreshed, and no update since);
    anchor_refreshed_at: the update of the last refresh (0 = the initial model). val_first:
    {metric: [mean, std]} over the videos of the first validation (the hacking check's baseline; `reward_total` and
    the held-out metrics); hacking_warned: {held-out metric: step of its warning} (each warns once per run)."""

    controller: AdaptiveKLController
    sampler: GroupSampler
    step: int = 0
    updates: int = 0
    accum_rounds: int = 0
    pending_kl_sum: float = 0.0
    pending_kl_pairs: int = 0
    skipped_updates: int = 0  # updates dropped for a non-finite gradient norm or no valid pair (whole run)
    failed_reward_steps: int = 0  # steps without a single finite reward (whole run)
    failed_streak: int = 0  # ... in a row, up to now
    anchor_synced: bool = True
    anchor_refreshed_at: int = 0
    val_first: dict = field(default_factory=dict)
    hacking_warned: dict = field(default_factory=dict)

    def state_dict(self) -> dict:
        return {f.name: _state_of(getattr(self, f.name)) for f in fields(self)}

    def load_state_dict(self, state: dict) -> None:
        missing = [f.name for f in fields(self) if f.name not in state]
        if missing:
            raise SageGRPOError(f"the checkpoint's train state has no {', '.join(missing)}: it was written by an "
                                "older sage-grpo; resume it with that version or start a new run")
        for f in fields(self):
            value = getattr(self, f.name)
            if hasattr(value, "load_state_dict"):
                value.load_state_dict(state[f.name])
            else:
                setattr(self, f.name, type(value)(state[f.name]))


def _state_of(value):
    return value.state_dict() if hasattr(value, "state_dict") else value


# ------------------------------------------------------------------------------------------------------ setup


def setup(cfg: Config, info: DistInfo, resume: Path | None) -> tuple[Components, TrainState]:
    """Read the prompts, load the models (sharded under FSDP2), encode every prompt the run uses, build the
    optimizer, anchor, reward and sampler settings; restore `resume` when given."""
    from sage_grpo.anchor import Anchor
    from sage_grpo.cli import check_writable_dir
    from sage_grpo.data import GroupSampler, read_prompts
    from sage_grpo.equalizer import equalizer_weights
    from sage_grpo.heldout import HeldOut
    from sage_grpo.kl import AdaptiveKLController
    from sage_grpo.models.image_cond import ImageConditioningCache
    from sage_grpo.models.loading import load_pipeline, read_text_encoders
    from sage_grpo.models.text_cache import TextEmbeddingCache
    from sage_grpo.models.tiny_checkpoint import ensure_tiny_checkpoint
    from sage_grpo.optim import build_optimizer
    from sage_grpo.rewards import build_reward_from_config
    from sage_grpo.rollout import SamplerSettings, latent_shape
    from sage_grpo.schedule import sigma_schedule
    from sage_grpo.sde import step_variance
    from sage_grpo.window import window_masks

    m, r, v = cfg.model, cfg.rollout, cfg.validation
    # a private probe file per rank; the folder is made by its first file (a run that fails loading leaves none)
    out = check_writable_dir(cfg.checkpoint.output_dir, "--output_dir", create=False)
    prompts = read_prompts(cfg.data.train_video_csv)
    val_records = load_validation_records(cfg, prompts)
    ensure_tiny_checkpoint(cfg.model.model_path, is_main=info.is_main, log=lambda msg: print0(info, msg))

    # the reward before the policy: a user's reward (import path, server) that cannot be built or called fails in
    # one line in seconds, not after the policy has loaded
    reward = build_reward_from_config(cfg, info.device)
    probe_user_rewards(cfg, reward, [rec.prompt for rec in prompts], info.device)
    dtype = torch_dtype(m.dtype)
    # the conditioning parts first (text encoders, VAE, SigLIP; the transformer a meta-device stand-in): every prompt
    # and image is encoded, the text encoders freed, and only then the policy loaded, so that the 7B text encoder
    # and the 8.3B transformer never share memory
    pipe = load_pipeline(m.pretrained_model_root, m.model_path, m.pretrained_transformer_version, dtype=dtype,
                         device=info.device, load_text_encoders=False, load_transformer=False)
    resolve_checkpoint_defaults(cfg, pipe.sage_grpo_location)  # done by preflight when it found the model already
    if m.vae_tiling:
        pipe.vae.enable_tiling()

    # every prompt the run will use, encoded once (a prompt missed here is still encoded on first use)
    # under torchrun the embeddings live on disk beside the run (a rank holding every prompt needs ~0.9 MB each:
    # 8.6 GB for 10,000 prompts), each rank encoding its share once
    cache_dir = m.text_embedding_cache_dir or (str(out / "text_embeddings") if info.distributed else None)
    # the text encoders load only if a prompt is not on disk yet (a resumed run, or a shared cache, never reads them)
    cache = TextEmbeddingCache(pipe, info.device, dtype, cache_dir,
                               loader=lambda: read_text_encoders(pipe.sage_grpo_location, dtype))
    validates = bool(v.validation_interval) or v.validate_at_step0
    needed = [p.prompt for p in prompts] + ([rec.prompt for rec in val_records] if validates else [])
    if r.cfg_scale != 1.0 or (validates and v.validation_guidance_scale != 1.0):
        needed.append(r.neg_prompt)
    cache.precompute(needed, info)  # collective: each distinct prompt is encoded by one rank
    images, buckets, shape = None, None, latent_shape(pipe.vae.config, r.sample_n_frames, r.height, r.width)
    if pipe.sage_grpo_task == "i2v":
        check_prompt_tasks(cfg, "i2v", prompts, val_records)  # also here: preflight may not have found the model yet
        # every reference image encoded once (VAE mode + SigLIP), kept on CPU beside the text embeddings
        images = ImageConditioningCache(pipe, info.device, dtype, cache_dir)  # files beside the text embeddings
        images.precompute([rec.ref_image_path for rec in prompts]
                          + ([rec.ref_image_path for rec in val_records] if validates else []), info)
        shape, buckets, sizes = i2v_size_buckets(cfg, pipe, images, prompts)
        print0(info, f"image-to-video: {len(images)} reference images, {sizes}")
    else:
        check_prompt_tasks(cfg, "t2v", prompts, val_records)
    if m.offload_text_encoder:
        cache.release_encoders()
        if images is not None:
            images.offload_encoder()
    warn_checkpoint_defaults(cfg, info, pipe)
    transformer, trainable = load_policy(cfg, info, pipe)
    optimizer = build_optimizer([(n, p) for n, p in transformer.named_parameters() if p.requires_grad], cfg.optim)
    anchor = Anchor(transformer, cfg, info, sharded=uses_fsdp(cfg, info))

    settings = SamplerSettings.from_config(cfg)
    sigmas = sigma_schedule(r.grpo_sampling_steps, r.flow_shift)
    variance = step_variance(r.sde_type, sigmas[:-1], sigmas[1:], r.eta, sigma_max=sigmas[1],
                             sage_clamp=r.sage_sigma_clamp)
    windows = window_masks(r.grpo_sampling_steps, r.sde_window_start, r.sde_window_size, r.sde_window_stride)  # [P, T]
    s_t = torch.stack([equalizer_weights(r.sde_type, sigmas, r.eta, cps_logprob=r.cps_logprob,
                                         sage_clamp=r.sage_sigma_clamp, steps=w)
                       if cfg.optim.use_grad_balancing else torch.ones(r.grpo_sampling_steps) for w in windows])
    vh, vw = parse_size(v.validation_fixed_size, "--validation_fixed_size")
    spec = validation_metrics_spec(cfg, val_records)
    # a reward named in --validation_metrics is built (its model loaded) only when the run validates
    extra = {n: build_reward_from_config(replace(cfg, reward=replace(cfg.reward, reward_model=n, reward_weights="",
                                                                     reward_optional="")),
                                         info.device) for n in spec.rewards} if validates else {}
    val_settings = SamplerSettings(sde_type="ode", eta=0.0, num_steps=v.validation_num_inference_steps,
                                   shift=v.validation_timestep_shift, cfg_scale=v.validation_guidance_scale,
                                   compute_dtype=dtype, autocast=settings.autocast, master_dtype=settings.master_dtype)
    c = Components(
        cfg=cfg, info=info, out=out, pipe=pipe, transformer=transformer, trainable=trainable, optimizer=optimizer,
        anchor=anchor, reward=reward, cache=cache, prompts=prompts,
        val_records=val_records, settings=settings, val_settings=val_settings,
        shape=shape,
        val_shape=latent_shape(pipe.vae.config, v.validate_video_length, vh, vw),
        windows=windows, step_weights=s_t.float(), variance=variance.float(), heldout=HeldOut(spec, reward, extra),
        images=images,
    )
    state = TrainState(
        controller=AdaptiveKLController.from_config(cfg.kl),
        sampler=GroupSampler(len(prompts), batch_size=cfg.data.batch_size, num_generations=cfg.data.num_generations,
                             dp_size=info.dp_size, seed=cfg.optim.seed, buckets=buckets),
        anchor_synced=anchor.equals_initial_policy,
    )
    if resume is not None:
        load_checkpoint(c, state, resume)
    return c, state


def probe_user_rewards(cfg: Config, reward, prompts: list[str], device: torch.device) -> None:
    """Call each reward given by import path once on 2 test videos of the rollout's size (deterministic noise, the
    first training prompts): one SageGRPOError line when it raises or returns missing components or wrong shapes.
    The built-in rewards are tested in the repository and skip this (VideoAlign's forward is not free)."""
    from sage_grpo.rewards import check_first_call, is_import_path

    r = cfg.rollout
    users = {n: rw for n, rw in reward.rewards.items() if is_import_path(n)}
    if not users:
        return
    gen = torch.Generator().manual_seed(0)
    videos = torch.rand(2, r.sample_n_frames, 3, r.height, r.width, generator=gen).to(device)  # [2, F, 3, H, W]
    texts = (prompts * 2)[:2]
    for name, rw in users.items():
        check_first_call(rw, name, videos, texts)


def load_validation_records(cfg: Config, prompts: list[PromptRecord]) -> list[PromptRecord]:
    from sage_grpo.data import PromptRecord, read_prompts

    v = cfg.validation
    if v.valid_video_csv:
        return read_prompts(v.valid_video_csv)
    if v.validation_prompts:
        return [PromptRecord(prompt=p, index=i) for i, p in enumerate(v.validation_prompts)]
    return list(prompts[: min(4, len(prompts))])


# (config group, key, checkpoint default) of the sampling settings a checkpoint decides when the user does not
SAMPLING_DEFAULTS = (("rollout", "flow_shift", "flow_shift"), ("rollout", "cfg_scale", "guidance_scale"),
                     ("validation", "validation_timestep_shift", "flow_shift"),
                     ("validation", "validation_guidance_scale", "guidance_scale"))


def resolve_checkpoint_defaults(cfg: Config, loc) -> dict:
    """The flow shifts and CFG scales that no flag or YAML key sets take the checkpoint's own (its scheduler and
    guider configs: shift 9 for 720p T2V, 7 for 720p I2V and the step-distilled model, guidance 1 for the
    distilled ones) -> {key: value} changed (recorded on cfg.from_checkpoint for the start-up print). The config
    is checked again with them (e.g. the sage_grpo schedule at the new shift). A Config not from load_config (no
    record of what the user set) is left alone."""
    from sage_grpo.config import check_values
    from sage_grpo.models.loading import checkpoint_sampling_defaults

    explicit = getattr(cfg, "explicit", None)
    if explicit is None:
        return {}
    defaults = checkpoint_sampling_defaults(loc)
    changed = {}
    for group, key, what in SAMPLING_DEFAULTS:
        if key not in explicit and not math.isclose(getattr(getattr(cfg, group), key), defaults[what]):
            setattr(getattr(cfg, group), key, defaults[what])
            changed[key] = defaults[what]
    if changed:
        check_values(cfg)
    cfg.from_checkpoint = {**getattr(cfg, "from_checkpoint", {}), **changed}
    return changed


def warn_checkpoint_defaults(cfg: Config, info: DistInfo, pipe) -> None:
    """Print the sampling settings taken from the checkpoint; warn where a flag the user set differs from the
    checkpoint's own default (its scheduler and guider configs; a CFG scale of 1, CFG off, gets a note), and about
    GRPO on the step-distilled model."""
    taken = getattr(cfg, "from_checkpoint", {})
    if taken:
        print0(info, "from the checkpoint's scheduler/guider configs: "
               + ", ".join(f"--{k} {v:g}" for k, v in taken.items()))
    r, v = cfg.rollout, cfg.validation
    shift, scale = float(pipe.scheduler.config.shift), float(pipe.guider.guidance_scale)
    for flag, value, default in (("--flow_shift", r.flow_shift, shift), ("--cfg_scale", r.cfg_scale, scale),
                                 ("--validation_timestep_shift", v.validation_timestep_shift, shift),
                                 ("--validation_guidance_scale", v.validation_guidance_scale, scale)):
        if math.isclose(value, default):
            continue
        if "shift" not in flag and value == 1.0:
            # CFG off is a recipe (one forward a step), not a scale carried over from another checkpoint
            print0(info, f"{flag} 1: classifier-free guidance off (the checkpoint's guider config has {default:g})")
        else:
            print0(info, f"warning: {flag} {value:g} differs from the checkpoint's own default {default:g} (its "
                   f"{'scheduler' if 'shift' in flag else 'guider'} config); pass {flag} {default:g} to use it")
    if pipe.transformer.config.use_meanflow:
        print0(info, "warning: GRPO on the step-distilled (MeanFlow) checkpoint is questionable: its velocity is the "
               "average over each step's interval (timestep_r = the next timestep), distilled for 8-12 deterministic "
               "Euler jumps, while the SDE samplers treat it as the instantaneous flow-matching velocity, so the "
               "rollout log-probabilities describe a process the model was not distilled for; allowed, but check "
               "its ODE validation videos")


def check_prompt_tasks(cfg: Config, task: str, prompts: list[PromptRecord], val_records: list[PromptRecord]) -> None:
    """The training prompts (and the validation prompts, when the run validates) fit the checkpoint's task."""
    from sage_grpo.models.image_cond import check_task

    v = cfg.validation
    check_task(task, prompts, f"--train_video_csv {cfg.data.train_video_csv}")
    if v.validation_interval or v.validate_at_step0:
        check_task(task, val_records, f"--valid_video_csv {v.valid_video_csv}" if v.valid_video_csv
                   else "--validation_prompts" if v.validation_prompts else "the validation prompts")


def i2v_size_buckets(cfg: Config, pipe, images: ImageConditioningCache, prompts: list[PromptRecord]
                     ) -> tuple[tuple, list, str]:
    """The size buckets of an I2V run's training images -> (the rollout latent [C, F, h, w] of the bucket with the
    most prompts, the latent (h, w) of each prompt for the sampler, a line naming the sizes). A rollout batch stacks
    latents of one shape, so every step draws its prompts from one bucket (`GroupSampler`'s `buckets`) and the
    rollout takes the step's size from its images."""
    from sage_grpo.rollout import latent_shape

    keys = [images.latent_hw(rec.ref_image_path) for rec in prompts]
    counts: dict = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    s = pipe.vae.config.spatial_compression_ratio
    h, w = max(counts, key=counts.get)  # ties: the first bucket of the file
    if len(counts) == 1:
        sizes = f"training videos {h * s}x{w * s} (their bucket; --height/--width apply to text-to-video)"
    else:
        listing = ", ".join(f"{bh * s}x{bw * s} ({n} prompts)" for (bh, bw), n in counts.items())
        sizes = (f"training videos in {len(counts)} size buckets: {listing}; each step draws its prompts from one "
                 "bucket, chosen with probability proportional to its prompts")
    return latent_shape(pipe.vae.config, cfg.rollout.sample_n_frames, h * s, w * s), keys, sizes


def validation_metrics_spec(cfg: Config, val_records: list[PromptRecord]):
    """`--validation_metrics` resolved against the trained reward and the validation prompts (preflight checks it
    before any model loads, setup uses it)."""
    from sage_grpo.heldout import parse_validation_metrics

    return parse_validation_metrics(cfg.validation.validation_metrics, cfg.reward.reward_model.split(","),
                                    [rec.prompt for rec in val_records],
                                    has_images=any(rec.ref_image_path for rec in val_records))


def uses_fsdp(cfg: Config, info: DistInfo) -> bool:
    """FSDP2 shards the policy when asked and there is more than one process (one process trains unsharded)."""
    return cfg.parallel.enable_fsdp and info.distributed


def load_policy(cfg: Config, info: DistInfo, pipe) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """-> (transformer, trainable parameters), put into `pipe` in place of its meta-device stand-in, parallelised by
    `sage_grpo.models.parallelize` (sequence parallelism, activation checkpointing, FSDP2). Under FSDP2 it is built
    on the meta device and each rank reads only its rows of the weights (no rank ever holds the whole model);
    otherwise the whole model is loaded and the LoRA adapter (if any) injected."""
    from sage_grpo.models.attention import set_attention_backend
    from sage_grpo.models.fp8 import quantize_base
    from sage_grpo.models.loading import attach_transformer, load_transformer
    from sage_grpo.models.lora import setup_trainable
    from sage_grpo.models.parallelize import load_sharded_transformer, parallelize

    m = cfg.model
    loc = pipe.sage_grpo_location
    dtype = torch_dtype(m.dtype)
    master = torch_dtype(m.master_weight_type)
    # LoRA trains the adapters only: they hold the master dtype, the frozen base stays in the compute dtype (an fp32
    # copy of the 8.3B base is 33 GB in host memory on the way to the device, more than many GPU hosts have)
    base = dtype if m.use_lora else master
    lora = dict(use_lora=m.use_lora, lora_r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
                lora_target_modules=m.lora_target_modules, pretrained_lora_path=m.pretrained_lora_path,
                adapter_dtype=master if m.use_lora else None)
    if uses_fsdp(cfg, info):
        # the velocity the root returns is a view; predict_velocity never modifies it in place, which is what
        # this FSDP2 warning is about
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        if loc.layout != "diffusers":
            raise SageGRPOError(f"--enable_fsdp loads the diffusers layout only; convert {loc.root} first with "
                                "scripts/convert_authors_checkpoint.py, or pass --enable_fsdp False")
        torch.manual_seed(cfg.optim.seed)  # the LoRA A matrices: drawn exactly as the unsharded path draws them
        transformer, trainable = load_sharded_transformer(
            loc.root / "transformer", info, master_dtype=master, base_dtype=base, param_dtype=dtype,
            lora=lora, fp8={"fp8_matmul": m.fp8_matmul} if m.fp8_base else None,
            gradient_checkpointing=m.enable_gradient_checkpointing, compile=m.compile)
        attach_transformer(pipe, transformer)  # a sharded transformer already sits where its shards belong
    else:
        transformer = load_transformer(loc, base)
        if m.fp8_base:  # each block's linears moved to the device and quantized there: the bf16 blocks never all are
            quantize_base(transformer, info.device, fp8_matmul=m.fp8_matmul)
        transformer = transformer.to(info.device)
        attach_transformer(pipe, transformer)
        torch.manual_seed(cfg.optim.seed)  # the LoRA A matrices are drawn from the global generator
        trainable = setup_trainable(transformer, **lora)
        parallelize(transformer, info, gradient_checkpointing=m.enable_gradient_checkpointing, compile=m.compile)
    set_attention_backend(transformer, m.attention_backend)  # every block's processor, Ulysses' included
    return transformer, trainable



# ------------------------------------------------------------------------------------------------------ train


class PhaseClock:
    """Seconds per phase of one step (the loop's perf/* metrics). `hook(name)`, when given, is a context manager
    entered around each phase: scripts/bench_step.py tags its counters with it. `meter` (sage_grpo.flops.FlopMeter),
    when given, counts the transformer's model FLOPs per phase: perf/<phase>_tflop, TFLOP/s and, with a peak, MFU."""

    TRAINING = ("refresh", "rollout", "reward", "plan", "anchor", "update", "optimizer")  # perf/step_s sums these

    def __init__(self, hook=None, meter=None, peak_tflops: float | None = None):
        self.hook, self.meter, self.peak = hook, meter, peak_tflops
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        if self.meter is not None:
            self.meter.phase = name
        try:
            with self.hook(name) if self.hook is not None else nullcontext():
                yield
        finally:
            if self.meter is not None:
                self.meter.phase = None
        self.seconds[name] += time.perf_counter() - t0

    def metrics(self) -> dict:
        from sage_grpo.flops import mfu

        out = {f"perf/{k}_s": v for k, v in self.seconds.items()}
        out["perf/step_s"] = sum(self.seconds.get(k, 0.0) for k in self.TRAINING)
        if self.meter is None:
            return out
        flop = self.meter.take()  # {phase: this rank's model FLOPs}
        flop["step"] = sum(v for k, v in flop.items() if k in self.TRAINING)
        for phase, f in flop.items():
            seconds = out[f"perf/{phase}_s"]
            out[f"perf/{phase}_tflop"] = f / 1e12
            if seconds > 0:
                out[f"perf/{phase}_tflops"] = f / 1e12 / seconds
            if (u := mfu(f, seconds, self.peak)) is not None:
                out[f"perf/{phase}_mfu"] = u
        return out


def train(c: Components, state: TrainState, logger=None, *, hook=None, final_save: bool = True) -> None:
    """The loop: until max_steps, or a stop signal (checkpoint, return), or too many steps without a finite reward
    (checkpoint, error). `logger` receives the metrics on rank 0 (None elsewhere); `hook` see PhaseClock;
    `final_save` False skips the checkpoint after the last step (the benchmark)."""
    from sage_grpo.flops import device_peak_tflops
    from sage_grpo.grpo import UpdateStats
    from sage_grpo.metrics import plot_curves
    from sage_grpo.parallel.dist import mean_metrics
    from sage_grpo.rewards.overlap import EarlyScores

    cfg, info = c.cfg, c.info
    v, ck, o = cfg.validation, cfg.checkpoint, cfg.optim
    if v.validate_at_step0 and state.step == 0:
        with PhaseClock(hook)("validation"):
            log(logger, 0, validation(c, state, 0))
            log_videos(logger, c, 0)
    last_saved = state.step
    live = LiveNumbers(info.is_main, o.max_steps, state.step, cfg.logging.log_interval)
    meter, peak = flop_meter(c), device_peak_tflops(cfg.logging.peak_tflops, info.device, cfg.model.dtype)
    with StopRequest() as stop:
        while state.step < o.max_steps:
            clock = PhaseClock(hook, meter, peak)
            # a moving anchor is refreshed between updates only, never inside an accumulation
            if state.accum_rounds == 0 and c.anchor.due(state.updates, state.anchor_refreshed_at):
                with clock("refresh"):
                    c.anchor.refresh()
                state.anchor_refreshed_at, state.anchor_synced = state.updates, True
            metrics: dict = {"kl/anchor_synced": int(state.anchor_synced),
                             "rollout/window_start": int(c.windows[window_of(c, state)].int().argmax())}
            # a reward on the CPU scores each finished chunk while the next one samples (EarlyScores); else in order.
            # A rollout or reward phase that raises cancels the chunks not yet scored (EarlyScores.__exit__)
            with EarlyScores(c.reward, c.info, c.pipe.vae) if overlaps_reward(c) else nullcontext() as early:
                with clock("rollout"):
                    traj = rollout_phase(c, state) if early is None else rollout_phase(c, state, early)
                with clock("reward"):
                    adv, valid, reward_metrics = (reward_phase(c, traj) if early is None
                                                  else reward_phase(c, traj, early))
            metrics.update(reward_metrics)
            # no finite reward on any rank (every rank sees the gathered rewards, so all agree): nothing to learn, but
            # the round still counts toward the pending update (with no gradient), so updates fall on the same steps
            # whatever fails and saves at multiples of save_interval stay on update boundaries
            failed = reward_metrics["reward/failed"] == reward_metrics["reward/videos"]
            if failed:
                state.failed_reward_steps += 1
                state.failed_streak += 1
                batches = [[]]
            else:
                state.failed_streak = 0
                with clock("plan"):
                    batches = micro_batches_of(c, plan_round(c, state, traj))
                with clock("anchor"):
                    batches = anchor_means(c, state, traj, batches)
            total = UpdateStats()
            # one entry of `batches` per optimizer update of this round (updates_per_rollout > 1 needs
            # gradient_accumulation_steps 1); with one, the update completes every accumulation rounds
            for mbs in batches:
                if mbs:
                    with clock("update"):
                        stats = backward_phase(c, state, traj, adv, valid, mbs)
                    total.merge(stats)
                    state.pending_kl_sum += stats.sums.get("kl/loss", 0.0)
                    state.pending_kl_pairs += stats.pairs
                state.accum_rounds += 1
                if state.accum_rounds == o.gradient_accumulation_steps:
                    with clock("optimizer"):
                        metrics.update(optimizer_step(c, state))
            if not failed:
                metrics.update(total.summary())
                metrics["train/masked_pairs"] = total.masked_pairs
            state.step += 1
            metrics["train/updates"] = state.updates
            metrics["train/failed_reward_steps"] = state.failed_reward_steps
            if v.validation_interval and state.step % v.validation_interval == 0:
                with clock("validation"):
                    metrics.update(validation(c, state, state.step))
                    log_videos(logger, c, state.step)
                if info.is_main:
                    plot_curves(c.out / "metrics.jsonl", c.out / "curves.png")
            metrics.update(clock.metrics())
            metrics["mem/peak_gib"] = peak_memory_gib(info.device)
            if state.step % cfg.logging.log_interval == 0 or state.step == o.max_steps:
                log(logger, state.step, mean_metrics(metrics))  # collective: every rank reaches it at the same steps
            live.update(state.step, metrics)
            if ck.save_interval and state.step % ck.save_interval == 0:
                save(c, state)
                last_saved = state.step
            limit = cfg.reward.max_failed_reward_steps
            if limit and state.failed_streak >= limit:
                if last_saved != state.step:
                    save(c, state)
                raise SageGRPOError(
                    f"no finite reward in the last {state.failed_streak} steps (--max_failed_reward_steps {limit}); "
                    f"checkpoint-{state.step} is saved. Check the reward model (paths, --reward_dtype, "
                    "--reward_max_pixels) and resume with --resume_from_checkpoint latest")
            if stop.agreed(info.device):
                if last_saved != state.step:
                    save(c, state)
                    last_saved = state.step
                print0(info, f"stopped by {stop.signal or 'a signal on another rank'} after step {state.step}; "
                       f"checkpoint-{state.step} is saved; continue with --resume_from_checkpoint latest")
                mark_clean_stop(info, state.step)
                break
    live.close()
    meter.close()
    if state.hacking_warned:
        print0(info, "warning: held-out metrics moved the wrong way while the trained reward rose (possible reward "
               "hacking): " + ", ".join(f"{k} (step {s})" for k, s in state.hacking_warned.items()))
    if final_save and last_saved != state.step:  # the final checkpoint: collective, every rank calls it
        save(c, state)


def flop_meter(c: Components):
    """A FlopMeter on the policy and on the anchor's own module (full fine-tuning), attached after the anchor was
    copied from the policy (a hook on the policy would be copied with it)."""
    from sage_grpo.flops import FlopMeter

    m = c.cfg.model
    meter = FlopMeter(lora_r=m.lora_r if m.use_lora else 0, sp_size=c.info.sp_size).attach(c.transformer)
    if c.anchor.model is not None:
        meter.attach(c.anchor.model)
    return meter


class LiveNumbers:
    """What a run shows on rank 0: on a terminal, the step bar with the reward mean, L_KL, clip fraction, seconds per
    step, the step's transformer TFLOP/s and (with a known peak) MFU; in a log file (no terminal), one compact line
    every log_interval steps instead of tqdm's redraws."""

    KEYS = (("reward", "reward/total_mean", "{:.4f}"), ("kl", "kl/loss", "{:.2e}"),
            ("clip", "train/clipfrac", "{:.3f}"), ("s/step", "perf/step_s", "{:.2f}"),
            ("TFLOP/s", "perf/step_tflops", "{:.3g}"), ("MFU", "perf/step_mfu", "{:.1%}"))

    def __init__(self, main: bool, total: int, initial: int, every: int):
        self.main, self.total, self.every = main, total, every
        self.terminal = main and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, desc="steps", disable=not self.terminal)

    def fields(self, metrics: dict) -> dict[str, str]:
        return {name: fmt.format(metrics[key]) for name, key, fmt in self.KEYS if key in metrics}

    def update(self, step: int, metrics: dict) -> None:
        if self.terminal:
            self.bar.set_postfix(self.fields(metrics), refresh=False)
            self.bar.update(1)
        elif self.main and (step % self.every == 0 or step == self.total):
            print(f"[post_train] step {step}/{self.total}  "
                  + "  ".join(f"{k} {v}" for k, v in self.fields(metrics).items()), flush=True)

    def close(self) -> None:
        self.bar.close()


def mark_clean_stop(info: DistInfo, step: int) -> None:
    """Tell `sage_grpo.launch` (the launch scripts' torchrun) that this node's workers stopped cleanly, so that it
    exits 0: each node's local rank 0 writes the file that the launcher named."""
    import os

    from sage_grpo.launch import STOP_FILE_ENV

    path = os.environ.get(STOP_FILE_ENV)
    if path and info.local_rank == 0:
        Path(path).write_text(f"{step}\n")


def log(logger, step: int, metrics: dict) -> None:
    if logger is not None:
        logger.log(step, metrics)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB -> GiB (peak RSS)


class StopRequest:
    """SIGTERM (schedulers, torchrun forwarding a kill) or SIGINT (Ctrl-C) ask the loop to stop: the current step
    finishes, the ranks agree (a rank that got no signal follows the others), a checkpoint is written and the run
    exits 0. Signals within REPEAT_WINDOW_S of the first are copies of the same request, not a second one: SLURM
    signals every process of the job step and torchrun forwards its own copy, and a terminal's Ctrl-C reaches
    torchrun and the workers alike, so a worker gets the same signal twice within milliseconds. A signal after the
    window interrupts at once; the last complete checkpoint is then what a resume starts from."""

    REPEAT_WINDOW_S = 10.0

    def __init__(self):
        self.signal: str | None = None
        self._first_at = 0.0
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signal is not None:
            if now - self._first_at < self.REPEAT_WINDOW_S:
                return  # a copy of the first request (scheduler + torchrun, or the terminal's process group)
            raise KeyboardInterrupt
        self.signal, self._first_at = signal.Signals(signum).name, now
        print(f"[post_train] {self.signal}: finishing this step, then a checkpoint (a signal more than "
              f"{self.REPEAT_WINDOW_S:g} s from now stops at once)", file=sys.stderr, flush=True)

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop (collective: every rank calls it once per step)."""
        from sage_grpo.parallel.dist import all_reduce_sum

        flag = all_reduce_sum(torch.tensor([float(self.signal is not None)], device=device))
        return float(flag[0]) > 0


# ------------------------------------------------------------------------------------------------------ phases


def overlaps_reward(c: Components) -> bool:
    """Whether scoring overlaps the rollout: --reward_overlap, every reward says its work is on the CPU
    (`runs_on_cpu`: the remote client, the detecting world rewards, a user's reward that says so; a reward on the
    accelerator would compete with the rollout for it) and more than one chunk of --mini_batch_size_per_update
    videos on the rank. Any --sp_size: EarlyScores shares the videos between the sp peers."""
    cfg = c.cfg
    return (cfg.reward.reward_overlap and getattr(c.reward, "runs_on_cpu", False) is True
            and cfg.data.batch_size > cfg.optim.mini_batch_size_per_update)


def rollout_phase(c: Components, state: TrainState, early: EarlyScores | None = None) -> Trajectory:
    """Sample this rank's videos of the next step (the sampler advances) -> the trajectory (x_0..x_T, log-probs,
    the step's global group ids of my videos). `early`: each chunk of --mini_batch_size_per_update videos is
    sampled through all steps and handed to it at once (the same samples, another order)."""
    from sage_grpo.generation import record_noise_seed
    from sage_grpo.parallel.dist import all_gather_cat
    from sage_grpo.parallel.fsdp import keep_unsharded
    from sage_grpo.rollout import rollout
    from sage_grpo.seeding import derive_seed

    def agree_calls(n: int) -> int:  # the shared prefix's transformer calls: the most any rank makes
        return int(all_gather_cat(torch.tensor([n], device=info.device)).max())

    cfg, info = c.cfg, c.info
    step_prompts = state.sampler.next_step()
    mine = state.sampler.rank_slice(step_prompts, info.dp_rank)  # [(group, prompt index, generation)]
    recs = [c.prompts[p] for _, p, _ in mine]
    texts = [rec.prompt for rec in recs]
    cond = c.cache.get(texts)
    uncond = c.cache.get([cfg.rollout.neg_prompt] * len(texts)) if c.settings.use_cfg else None
    # each sample its own prompt's image (the authors gave a whole rank the first group's image); the sampler drew
    # the step from one size bucket, so the images stack and give the step's latent size
    image = c.images.get([rec.ref_image_path for rec in recs]) if c.images is not None else None
    # the noise of a group: its prompt and its position in the step (a prompt drawn twice in one step, from a small
    # prompt set, an epoch boundary or a small size bucket, is two groups with their own noise)
    seeds = [derive_seed(record_noise_seed(rec), g) for (g, _, _), rec in zip(mine, recs)]
    shape = c.shape if image is None else (*c.shape[:2], *image.latent_hw)  # [C, F, h, w]
    if early is not None:
        early.start(texts)
    c.transformer.eval()  # no LoRA dropout while sampling: the stored log-probs are the deterministic policy's
    # FSDP2: one all-gather per unit for the whole rollout instead of one per forward (resharded on exit)
    with keep_unsharded(c.transformer, enabled=not cfg.parallel.rollout_reshard_after_forward):
        return rollout(
            c.transformer, cond, uncond, prompts=texts, prompt_ids=torch.tensor([g for g, _, _ in mine]),
            generation_ids=torch.tensor([gen for _, _, gen in mine]),
            prompt_seeds=torch.tensor(seeds),
            latent_shape=shape, settings=c.settings, image_tokens=c.pipe.vision_num_semantic_tokens,
            base_seed=derive_seed(cfg.optim.seed, state.step), same_noise=cfg.rollout.use_same_noise,
            storage_dtype=torch.float32, show_progress=info.is_main and cfg.logging.verbose,
            chunk_size=cfg.optim.mini_batch_size_per_update, device=info.device,
            image=image,
            on_chunk=None if early is None else early.submit,
            sde_steps=c.windows[window_of(c, state)], share_prefix=cfg.rollout.shared_prefix, agree_calls=agree_calls,
        )


def window_of(c: Components, state: TrainState) -> int:
    """The position (row of c.windows) of the SDE window in this round: a sliding window moves with the optimizer
    updates done, which the train state saves, so a resumed run takes the same windows."""
    from sage_grpo.window import window_index

    return window_index(len(c.windows), c.cfg.rollout.sde_window_every, state.updates)


def window_of_rollout(c: Components, traj: Trajectory) -> int:
    """The row of c.windows a trajectory was sampled with (the update may have moved on since, with
    --updates_per_rollout > 1: the round trains the rollout's window)."""
    return int((c.windows == traj.sde_steps.cpu()).all(dim=1).nonzero()[0])


def reward_phase(c: Components, traj: Trajectory, early: EarlyScores | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Score (or collect the `early` scores), gather the rewards of all data-parallel ranks (a group may span
    several), group-relative advantages -> (my advantages [b], my valid [b], metrics)."""
    from sage_grpo.advantage import combine_components, group_advantages
    from sage_grpo.parallel.dist import all_gather_cat

    cfg, info = c.cfg, c.info
    names, mine = score_videos(c, traj, early)  # [b, K]
    # over the ranks with my sp_rank: one copy of each data-parallel rank's videos, in dp-rank order
    every = all_gather_cat(mine, group=info.dp_group)  # [B_global, K]
    groups = all_gather_cat(traj.prompt_ids.to(info.device), group=info.dp_group)  # [B_global]
    total = every[:, names.index("total")].cpu()
    if cfg.reward.reward_combine != "weighted_sum" or c.reward.optional:
        # the components combined over each group (optional ones, per-component normalisation): NaN = masked
        w = c.reward.weights
        total = combine_components(
            every.cpu(), torch.tensor([w.get(k, 0.0) for k in names]),
            torch.tensor([k not in c.reward.optional for k in names]), groups.cpu(),
            normalize=cfg.reward.reward_combine == "component_norm")
    adv, valid = group_advantages(total, groups.cpu(), adv_clip_max=cfg.optim.adv_clip_max)
    b = traj.batch_size
    sl = slice(info.dp_rank * b, (info.dp_rank + 1) * b)
    metrics = {}
    for j, k in enumerate(names):
        col = every[:, j].cpu().double()
        ok = torch.isfinite(col)
        metrics[f"reward/{k}_mean"] = float(col[ok].mean()) if ok.any() else math.nan
        metrics[f"reward/{k}_std"] = float(col[ok].std(unbiased=False)) if ok.any() else math.nan
    g = cfg.data.num_generations
    grouped = total.reshape(-1, g)  # [groups, G]: the global batch is whole groups in order
    metrics["reward/failed"] = int((~torch.isfinite(total)).sum())
    metrics["reward/videos"] = int(total.numel())
    metrics["reward/failed_groups"] = int((~torch.isfinite(grouped)).all(dim=1).sum())  # trained with weight 0
    metrics["adv/zero_std_groups_frac"] = float((grouped.std(dim=1, unbiased=False) == 0).float().mean())
    metrics["adv/abs_mean"] = float(adv[valid].abs().mean()) if valid.any() else 0.0
    metrics["adv/max"] = float(adv.max())
    metrics["adv/min"] = float(adv.min())
    return adv[sl].clone(), valid[sl].clone(), metrics


def score_videos(c: Components, traj: Trajectory, early: EarlyScores | None = None) -> tuple[list[str], torch.Tensor]:
    """Decode and score this data-parallel rank's videos -> (component names, [b, K] scores), each video decoded and
    scored once per sequence-parallel group: the sp peers hold the same b videos, each takes a contiguous share,
    and the shares are all-gathered inside the group. `early`: the scores asked for during the rollout."""
    from sage_grpo.parallel.dist import all_gather_cat
    from sage_grpo.rollout import decode_latents

    info, b = c.info, traj.batch_size
    names = sorted(["total", *c.reward.components])
    if early is not None:
        return names, early.collect(names, b)
    share = -(-b // info.sp_size)  # ceil(b / sp) rows per sp rank; the last ranks may get fewer (or none)
    lo, hi = min(info.sp_rank * share, b), min((info.sp_rank + 1) * share, b)
    mine = torch.full((share, len(names)), math.nan, device=info.device)  # [share, K], NaN rows = padding
    if hi > lo:
        frames = decode_latents(c.pipe.vae, traj.final_latents[lo:hi])  # [n, F, 3, H, W] in [0, 1]
        scores = c.reward(frames, traj.prompts[lo:hi])  # {"total": [n], component: [n]}
        mine[: hi - lo] = torch.stack([scores[k].float().to(info.device) for k in names], dim=1)
    if info.sp_size > 1:
        mine = all_gather_cat(mine, group=info.sp_group)  # [sp * share, K]
    return names, mine[:b]


def plan_round(c: Components, state: TrainState, traj: Trajectory) -> torch.Tensor:
    """The trained steps of each of my samples -> [b, k], from generators seeded by (seed, step, video), or by
    (seed, step, group) with --group_timesteps."""
    from sage_grpo.grpo import plan_generators, plan_steps

    cfg, b = c.cfg, traj.batch_size
    gens = plan_generators(cfg.optim.seed, state.step, c.info.dp_rank * b, b,
                           cfg.data.num_generations if cfg.optim.group_timesteps else 1)
    variance = c.variance * c.windows[window_of_rollout(c, traj)]  # [T]: only the window's steps are trained
    return plan_steps(b, variance, cfg.optim.timestep_fraction, cfg.optim.enable_timestep_permutation, gens)


def micro_batches_of(c: Components, plan: torch.Tensor) -> list[list[PairBatch]]:
    """Micro-batches per optimizer update of this round: the rollout's chunks, split over updates_per_rollout by
    their global index (the same samples in each update on any layout, sage_grpo.grpo.update_chunks)."""
    from sage_grpo.grpo import micro_batches, update_chunks

    b, o = plan.shape[0], c.cfg.optim
    return [micro_batches(plan, chunks) for chunks in
            update_chunks(c.info.dp_rank * b, b, o.mini_batch_size_per_update, o.updates_per_rollout)]


def anchor_means(c: Components, state: TrainState, traj: Trajectory,
                 batches: list[list[PairBatch]]) -> list[list[PairBatch]]:
    """kl_compute_mode rollout_phase: the micro-batches with the anchor's means of every planned pair, computed
    right after the rollout and kept on CPU. Unchanged when the anchor equals the rollout policy (the update then
    uses the policy's own means), without KL_pos, or in training_phase mode (the update asks the anchor itself)."""
    from sage_grpo.rollout import policy_step

    if not c.anchor.uses_pos or state.anchor_synced or c.cfg.kl.kl_compute_mode != "rollout_phase":
        return batches
    tokens = c.pipe.vision_num_semantic_tokens
    with c.anchor.active() as model, torch.no_grad():
        return [[replace(mb, ref_mean=policy_step(model, traj, mb.samples, mb.steps, tokens).mean.cpu())
                 for mb in mbs] for mbs in batches]


def backward_phase(c: Components, state: TrainState, traj: Trajectory, adv: torch.Tensor, valid: torch.Tensor,
                   mbs: list[PairBatch]) -> UpdateStats:
    """Backpropagate one optimizer update's share of this round's GRPO loss (its micro-batches) -> statistics."""
    from sage_grpo.grpo import UpdateStats, grpo_backward
    from sage_grpo.kl import kl_term_weights
    from sage_grpo.parallel.dist import all_reduce_sum
    from sage_grpo.rollout import policy_step

    cfg, info = c.cfg, c.info
    beta_pos, beta_vel = kl_term_weights(cfg.kl)
    if not c.anchor.uses_pos:
        beta_pos = 0.0
    tokens = c.pipe.vision_num_semantic_tokens
    c.transformer.train()

    def step_fn(i, t):
        return policy_step(c.transformer, traj, i, t, tokens)

    def anchor_fn(mb):
        with c.anchor.active() as model:
            return policy_step(model, traj, mb.samples, mb.steps, tokens).mean

    pairs = sum(int(valid[mb.samples].sum()) for mb in mbs)
    # the valid pairs of the update's earlier rounds and of this one, over all data-parallel ranks
    earlier, now = all_reduce_sum(torch.tensor([float(state.pending_kl_pairs), float(pairs)], dtype=torch.float64,
                                               device=info.device), group=info.dp_group).tolist()
    total = earlier + now
    # the gradient so far is the mean over the earlier pairs: rescaled to their sum over all pairs so far, and this
    # round adds its sum over them too, so after the last round it is the mean over every valid pair of the update
    # (of all ranks: the sync averages over them), however the rounds' pair counts differ
    if earlier > 0:
        for p in c.trainable:
            if p.grad is not None:
                p.grad.mul_(earlier / total)
    normalizer = max(total, 1.0) / info.dp_size
    stats = UpdateStats()
    for mb in mbs:
        stats.merge(grpo_backward(
            mb, step_fn, logp_old=traj.log_probs, advantages=adv, valid=valid,
            step_weights=c.step_weights[window_of_rollout(c, traj)],
            clip_range=cfg.optim.clip_range, normalizer=normalizer, kl_coef=state.controller.value,
            beta_pos=beta_pos, beta_vel=beta_vel, anchor_fn=anchor_fn, anchor_is_policy=state.anchor_synced,
        ))
    return stats


def optimizer_step(c: Components, state: TrainState) -> dict:
    """Sync, clip, step, count; then the KL controller moves with the rank-averaged L_KL of the update. Every rank
    decides the same (the norm and the pair count are taken after their all-reduce) -> metrics."""
    from sage_grpo.optim import clip_grad_norm, lr_at
    from sage_grpo.parallel.dist import all_reduce_sum, sync_gradients

    cfg, info = c.cfg, c.info
    sync_gradients(c.trainable, info, uses_fsdp(cfg, info))
    norm = clip_grad_norm(c.trainable, cfg.optim.max_grad_norm)  # identical on every rank after the all-reduce
    lr = lr_at(state.updates, cfg.optim.learning_rate, cfg.optim.warmup_steps)
    kl = all_reduce_sum(torch.tensor([state.pending_kl_sum, float(state.pending_kl_pairs)], dtype=torch.float64,
                                     device=info.device), group=info.dp_group)
    metrics: dict = {"train/grad_norm": norm, "train/lr": lr}
    stepped = math.isfinite(norm) and kl[1] > 0
    if stepped:
        c.optimizer.set_lr(lr)
        c.optimizer.step()
        state.updates += 1
        state.anchor_synced = False
    else:  # NaN/inf loss or gradients, or no valid pair: every rank skips, no divergent collectives
        state.skipped_updates += 1
    metrics["train/skipped_update"] = int(not stepped)
    metrics["train/skipped_updates_total"] = state.skipped_updates
    c.optimizer.zero_grad(set_to_none=True)
    state.accum_rounds, state.pending_kl_sum, state.pending_kl_pairs = 0, 0.0, 0
    if cfg.kl.kl_weight > 0:
        metrics["kl/coef"] = state.controller.value  # the coefficient this update used
        if stepped:
            state.controller.update(float(kl[0] / kl[1]))
    return metrics


def validation(c: Components, state: TrainState, step: int) -> dict:
    """ODE videos of the validation prompts (split over ranks) -> output_dir/samples/step_{step:06d}/, scored by the
    trained reward and the held-out metrics (`c.heldout`), reduced over ranks (one all-reduce) -> val/ metrics, and
    the hacking check (`watch_hacking`), which every rank runs on the same numbers."""
    from sage_grpo.generation import sample_stem, sample_videos, write_sample
    from sage_grpo.hacking import REWARD, Summary
    from sage_grpo.models.image_cond import reference_pixels
    from sage_grpo.parallel.dist import all_reduce_sum

    cfg, info = c.cfg, c.info
    folder = samples_dir(c, step)
    names = [REWARD, *c.heldout.names]
    first = not state.val_first  # the first validation of the run: its videos are the drift reference
    # prompts split over data-parallel ranks (sp peers make each video together); every rank runs the same number
    # of forwards, since FSDP2 and Ulysses forwards are collective: short ranks repeat a prompt and discard it
    per_rank = -(-len(c.val_records) // info.dp_size)
    mine = c.val_records[info.dp_rank :: info.dp_size]
    todo = mine + [c.val_records[0]] * (per_rank - len(mine))
    sums = torch.zeros(len(names), 3, dtype=torch.float64, device=info.device)  # per metric: sum, sum of squares, n
    for j, (rec, frames) in enumerate(sample_videos(
            c.pipe, c.cache, todo, settings=c.val_settings, shape=c.val_shape,
            base_seed=cfg.validation.validation_seed, negative_prompt=cfg.rollout.neg_prompt,
            show_progress=info.is_main and cfg.logging.verbose, decode=info.sp_rank == 0, images=c.images)):
        if j >= len(mine) or info.sp_rank != 0:  # padding, or an sp peer's copy: the sp leader writes and scores
            continue
        score = {k: float(v[0]) for k, v in c.reward(frames[None].to(info.device), [rec.prompt]).items()}
        reference = drift_reference(c, sample_stem(rec), frames, first) if c.heldout.drift else None
        # I2V: the reference image cropped to the video's size, for the first-frame fidelity (the reward never sees it)
        image = (reference_pixels(rec.ref_image_path, *frames.shape[-2:])
                 if c.heldout.reference and rec.ref_image_path else None)
        held = c.heldout.score(frames, rec.prompt, score, reference, image)
        write_sample(folder / f"{sample_stem(rec)}.mp4", frames, prompt=rec.prompt, fps=cfg.rollout.video_fps,
                     meta={"step": step, "reward": score, "heldout": held})
        for i, x in enumerate([score["total"], *held.values()]):
            if math.isfinite(x):
                sums[i] += torch.tensor([x, x * x, 1.0], dtype=torch.float64, device=info.device)
    sums = all_reduce_sum(sums).cpu()  # every rank joins, sp peers add zeros
    summaries = {}
    for name, (total, squares, n) in zip(names, sums.tolist()):
        mean = total / n if n > 0 else math.nan
        summaries[name] = Summary(mean, math.sqrt(max(squares / n - mean * mean, 0.0)) if n > 0 else math.nan)
    metrics = {"val/reward_total": summaries[REWARD].mean, "val/videos": int(sums[0, 2])}
    metrics.update({f"val/{k}": summaries[k].mean for k in c.heldout.names})
    metrics.update(watch_hacking(c, state, step, summaries))
    return metrics


def drift_reference(c: Components, stem: str, frames: torch.Tensor, first: bool) -> torch.Tensor | None:
    """The drift reference of a validation video (`sage_grpo.heldout.drift_frames` of the run's first validation's
    video of that prompt): written by the first validation to output_dir/validation_reference/<stem>.safetensors,
    read back by the later ones (None when it is not there, e.g. a resumed run on another filesystem)."""
    from safetensors.torch import load_file, save_file

    from sage_grpo.files import usual_permissions
    from sage_grpo.heldout import drift_frames

    path = c.out / "validation_reference" / f"{stem}.safetensors"
    if first:
        small = drift_frames(frames)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"frames": small}, str(path))
        usual_permissions(path)
        return small
    return load_file(str(path))["frames"] if path.is_file() else None


def watch_hacking(c: Components, state: TrainState, step: int, summaries: dict) -> dict:
    """The hacking check of one validation (`sage_grpo.hacking`): the first validation's summaries become the
    baseline (a metric without a finite one takes this validation's); each metric that moves the wrong way while
    the reward rises warns once (printed, kept in `state.hacking_warned`) -> val_shift/<metric> (the change since
    the first validation in spreads, as the check sees it) and val/hacking_warnings (warned metrics so far)."""
    from sage_grpo.hacking import hacking_warnings, shift

    if not c.heldout.senses:  # --validation_metrics none
        return {}
    for name, s in summaries.items():
        if name not in state.val_first or not math.isfinite(state.val_first[name][0]):
            state.val_first[name] = [s.mean, s.std]
    v = c.cfg.validation
    for w in hacking_warnings(state.val_first, summaries, c.heldout.senses, state.hacking_warned, step=step,
                              reward_rise=v.hacking_reward_rise, metric_drop=v.hacking_metric_drop):
        state.hacking_warned[w.metric] = step
        print0(c.info, "warning: " + w.message())
    out = {f"val_shift/{k}": shift(state.val_first[k], s) for k, s in summaries.items()
           if c.heldout.senses.get(k, 0) is not None}  # not drift, which starts at 0 by construction
    out["val/hacking_warnings"] = len(state.hacking_warned)
    return out


def samples_dir(c: Components, step: int) -> Path:
    """Where `validation` writes the videos of `step` and `log_videos` reads them back (one place for both)."""
    return c.out / "samples" / f"step_{step:06d}"


def log_videos(logger, c: Components, step: int) -> None:
    """The validation videos of `step` to TensorBoard / wandb (rank 0: `logger` is None on the other ranks; a
    logger without media, such as scripts/bench_step.py's, gets none). They are read back from the mp4s because
    validation splits the prompts over ranks and each rank wrote its own; all are on disk once `validation`'s
    all-reduce has returned."""
    if not getattr(logger, "wants_media", False):
        return
    from sage_grpo.generation import sample_stem
    from sage_grpo.video import read_video

    files = {sample_stem(rec): samples_dir(c, step) / f"{sample_stem(rec)}.mp4" for rec in c.val_records}
    logger.log_videos(step, {name: read_video(path)[0] for name, path in files.items() if path.is_file()})


# ------------------------------------------------------------------------------------------------------ checkpoints


def save(c: Components, state: TrainState) -> Path:
    """Write checkpoint-{step} (collective). A failed write (disk full, read-only) ends the run with one message;
    the older checkpoints are untouched."""
    from sage_grpo.checkpoint import CheckpointWriteError, list_checkpoints

    try:
        path = write_checkpoint(c, state)
    except CheckpointWriteError as err:
        done = list_checkpoints(c.cfg.checkpoint.output_dir)
        last = f"the last complete one is {done[-1][1]}" if done else "no complete checkpoint exists yet"
        raise SageGRPOError(f"{err}; {last}. Free space or fix the permissions of --output_dir, then resume with "
                            "--resume_from_checkpoint latest") from None
    print0(c.info, f"checkpoint {path}")
    return path


def write_checkpoint(c: Components, state: TrainState) -> Path:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from sage_grpo.checkpoint import (
        file_digests,
        pending_gradients,
        pending_kl_by_dp_rank,
        resolved_settings,
        save_checkpoint,
    )
    from sage_grpo.models.lora import save_lora, sharded_lora_state
    from sage_grpo.parallel.fsdp import gather_full

    fsdp, lora = uses_fsdp(c.cfg, c.info), c.cfg.model.use_lora
    a, initial = c.anchor, state.anchor_refreshed_at == 0  # the initial anchor is rebuilt exactly: not saved
    anchor_state = None if (a.model is None or initial) else get_model_state_dict(a.model)  # DTensors under FSDP2
    # small: gathered whole under FSDP2 (collective, every rank), then rank 0 writes it
    anchor_lora = None if (a.adapter is None or initial) else gather_full(a.adapter)
    lora_state = sharded_lora_state(c.transformer) if (fsdp and lora) else None  # collective, before rank 0 writes
    # a stop inside an accumulation (signal, failed-reward limit): the gradients of the rounds so far, so that the
    # resumed run adds the next rounds to them exactly as an uninterrupted run would
    gradients = pending_gradients(c.transformer, c.info, fsdp) if state.accum_rounds else None
    return save_checkpoint(
        c.cfg.checkpoint.output_dir, state.step, rank=c.info.rank, gradient_state=gradients or None,
        # a LoRA run's trained state is its adapter (lora/): a merged copy of the 8.3B base would cost 16.6 GB of
        # memory and disk at every save; export_checkpoint.py / generate.py merge it when asked
        model_state=None if lora else get_model_state_dict(c.transformer),
        optimizer_state=get_optimizer_state_dict(c.transformer, c.optimizer.optimizers),
        train_state={**state.state_dict(), "world_size": c.info.world_size, "config": config_to_dict(c.cfg),
                     "pending_kl_by_dp_rank": pending_kl_by_dp_rank(state.pending_kl_sum, state.pending_kl_pairs,
                                                                    c.info),
                     "digests": file_digests(config_to_dict(c.cfg)),  # a resume compares the judge template's text
                     "resolved": resolved_settings(c.reward),  # and the judge's model as asked for
                     "task": c.pipe.sage_grpo_task},  # the export's model card names the task's pipeline
        lora_writer=(lambda d: save_lora(c.transformer, d, state=lora_state)) if lora else None,
        anchor_state=anchor_state, anchor_lora=anchor_lora, total_limit=c.cfg.checkpoint.checkpoints_total_limit,
    )


def load_checkpoint(c: Components, state: TrainState, path: Path) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from sage_grpo.checkpoint import (
        dcp_load,
        exactness_diff,
        file_digests,
        load_pending_gradients,
        load_rng_state,
        read_train_state,
        resolved_settings,
        saved_layout,
        spread_pending_kl,
    )
    from sage_grpo.models.lora import load_lora, load_lora_sharded
    from sage_grpo.optim import optimizer_settings
    from sage_grpo.parallel.fsdp import copy_full_into_shards_

    saved = read_train_state(path)
    current = config_to_dict(c.cfg)
    layout = saved_layout(saved)
    diffs = exactness_diff(saved["config"], current, saved.get("digests"), file_digests(current),
                           saved_dp=layout["dp"] if layout else c.info.dp_size, current_dp=c.info.dp_size,
                           saved_resolved=saved.get("resolved"), current_resolved=resolved_settings(c.reward))
    if diffs:
        print0(c.info, "resuming with settings that differ from the saved run (the continuation is not exact): "
               + "; ".join(diffs))
    state.load_state_dict(saved)
    pending_kl = spread_pending_kl(saved.get("pending_kl_by_dp_rank"), c.info)
    if pending_kl is not None:
        state.pending_kl_sum, state.pending_kl_pairs = pending_kl
    if c.cfg.model.use_lora:
        (load_lora_sharded if uses_fsdp(c.cfg, c.info) else load_lora)(c.transformer, path / "lora")
    else:
        model = {"model": get_model_state_dict(c.transformer)}
        dcp_load(model, path / "transformer", "transformer weights")
        set_model_state_dict(c.transformer, model["model"])
    opt = {"optimizer": get_optimizer_state_dict(c.transformer, c.optimizer.optimizers)}
    dcp_load(opt, path / "optimizer", "optimizer state")
    set_optimizer_state_dict(c.transformer, c.optimizer.optimizers, opt["optimizer"])
    # the load brought back the saved run's hyper-parameters; the run's own (a resume's flags on top) are applied
    c.optimizer.apply_settings(optimizer_settings(c.cfg.optim))
    a, initial = c.anchor, state.anchor_refreshed_at == 0
    if a.model is not None and not initial:
        anchor = {"model": get_model_state_dict(a.model)}
        dcp_load(anchor, path / "anchor", "anchor weights")
        set_model_state_dict(a.model, anchor["model"])
    if a.adapter is not None and not initial:
        copy_full_into_shards_(a.adapter, load_file(path / "anchor_lora.safetensors"))  # plain tensors: a copy
    if (path / "gradients").is_dir():
        load_pending_gradients(c.transformer, c.info, uses_fsdp(c.cfg, c.info), path / "gradients")
    load_rng_state(path, c.info.rank, seed=c.cfg.optim.seed, step=state.step)
    print0(c.info, f"resumed from {path} at step {state.step} ({state.updates} optimizer updates)")


# ------------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> Path:
    import os

    from sage_grpo.checkpoint import clear_run, read_train_state, record_resume
    from sage_grpo.cli import quiet_libraries
    from sage_grpo.hostmem import free_host_memory_eagerly
    from sage_grpo.metrics import MetricsLogger, plot_curves
    from sage_grpo.parallel.dist import barrier, destroy, init_distributed

    cfg = load_config(argv, prog="post_train.py", description=__doc__)
    quiet_libraries(cfg.logging.verbose)
    free_host_memory_eagerly()  # else the ranks' hosts keep different amounts of freed memory (sage_grpo.hostmem)
    if cfg.logging.threads:
        torch.set_num_threads(cfg.logging.threads)
    local = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun's processes per node
    preflight(cfg, int(os.environ.get("WORLD_SIZE", "1")), int(local) if local else None)
    info = init_distributed(cfg.parallel.sp_size, cfg.parallel.dp_replicate, cfg.parallel.dist_timeout_minutes)
    logger = None
    ck = cfg.checkpoint
    try:
        resume = agreed_resume(cfg, info)
        if ck.resume_from_checkpoint and resume is None:
            print0(info, f"no checkpoint in {ck.output_dir}: starting from step 0")
        overridden = {}
        if resume is not None:
            overridden = take_run_settings(cfg, info, resume)
            report_layout_change(cfg, info, resume)
        if resume is not None and read_train_state(resume)["step"] >= cfg.optim.max_steps:
            print0(info, f"{resume.name} is already at --max_steps {cfg.optim.max_steps}: nothing to train (raise "
                   "--max_steps to continue)")
            return Path(ck.output_dir)
        if ck.overwrite_output_dir and info.is_main:
            clear_run(ck.output_dir)
        barrier()  # nothing of the previous run is read after this
        c, state = setup(cfg, info, resume)
        if info.is_main:
            dump_yaml(cfg, c.out / "config.yaml")
            if resume is not None:
                record_resume(c.out, resume, state.step, overridden, config_to_dict(cfg), info.world_size)
            logger = MetricsLogger(c.out, report_to=cfg.logging.report_to, run_name=cfg.logging.run_name,
                                   project=cfg.logging.wandb_project, config=config_to_dict(cfg),
                                   resume_step=state.step if resume is not None else None)
        train(c, state, logger)
        barrier()  # every rank done before any closes its connections (gloo aborts a peer still using them)
    finally:
        destroy()
    if logger is not None:
        logger.close()
        plot_curves(c.out / "metrics.jsonl", c.out / "curves.png")
    return c.out


def take_run_settings(cfg: Config, info: DistInfo, path: Path) -> dict:
    """The settings of the run `path` belongs to, with the command line's flags on top (sage_grpo.config.
    resume_settings), from the checkpoint all ranks agreed on (preflight took those of the one this process found:
    the same unless a node's listing was stale), said once -> the overridden {"group.key": (saved, flag)}."""
    from sage_grpo.checkpoint import read_train_state
    from sage_grpo.config import resume_settings

    overridden, kept = resume_settings(cfg, read_train_state(path)["config"])
    validate(cfg, world_size=info.world_size)
    if overridden:
        print0(info, "overridden on resume: " + "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in overridden.items()))
    if kept:
        print0(info, "the run keeps its own settings where --config differs (pass the flag to change one): "
               + "; ".join(f"{k}: {a!r} (--config: {b!r})" for k, (a, b) in kept.items()))
    return overridden


def report_layout_change(cfg: Config, info: DistInfo, path: Path) -> None:
    """Say, before any model loads, how this launch's layout differs from the one `path` was written on (nothing
    when it is the same), and which ranks' RNG files are not read or which ranks seed theirs anew."""
    from sage_grpo.checkpoint import layout_change, read_train_state

    saved = read_train_state(path)
    line = layout_change(saved, config_to_dict(cfg), info.world_size, path.name)
    if line is None:
        return
    old, now = int(saved["world_size"]), info.world_size

    def span(a: int, b: int) -> str:  # ranks a..b-1
        return str(a) if b == a + 1 else f"{a}..{b - 1}"

    if old > now:
        line += f"; rng_rank{span(now, old)} not read (no such rank now; nothing depends on the RNG state)"
    elif old < now:
        line += f"; rank {span(old, now)} new: RNG seeded from (seed, step, rank)"
    print0(info, line)


def preflight(cfg: Config, world_size: int, nproc_per_node: int | None = None) -> None:
    """Every check that needs no model, in one process, before any collective or model load, on the settings of the
    run a resume continues (its saved config, the command line's flags on top): flags against the world size (and
    the processes per node: a sequence-parallel group must not cross nodes), the resume target, the metrics sinks
    and the prompt files; on a GPU, the run's memory plan against its memory (sage_grpo.memory.check_device_memory: a
    warning). `scripts/check_launch.py` runs it for the launchers before torchrun spawns
    a worker, so a user error is one line, not one per rank."""
    import os

    from sage_grpo.checkpoint import read_train_state, resolve_resume, run_outputs
    from sage_grpo.config import resume_settings
    from sage_grpo.data import read_prompts
    from sage_grpo.metrics import check_report_to
    from sage_grpo.models.attention import check_attention_backend
    from sage_grpo.models.image_cond import check_reference_images
    from sage_grpo.models.loading import locate_model
    from sage_grpo.models.tiny_checkpoint import TINY_CHECKPOINT_DIR
    from sage_grpo.rewards import get_reward_builder, missing_reward_files

    ck = cfg.checkpoint
    resume = resolve_resume(ck.resume_from_checkpoint, ck.output_dir)
    if resume is not None:  # the saved run's settings, the command line's flags on top
        resume_settings(cfg, read_train_state(resume)["config"])
    validate(cfg, world_size=world_size)
    sp = cfg.parallel.sp_size
    if nproc_per_node is not None and nproc_per_node % sp:
        raise SageGRPOError(f"--sp_size {sp} must divide the processes per node ({nproc_per_node}): a "
                            "sequence-parallel group exchanges activations in every attention layer and must stay "
                            "inside one node")
    if resume is not None:
        check_resume_fits(cfg, resume)
    previous = run_outputs(ck.output_dir)
    if previous and not ck.resume_from_checkpoint and not ck.overwrite_output_dir:
        names = ", ".join(p.name for p in previous[:4]) + (", ..." if len(previous) > 4 else "")
        raise SageGRPOError(f"--output_dir {ck.output_dir} already holds a run ({names}): continue it with "
                            "--resume_from_checkpoint latest, or start over with --overwrite_output_dir (deletes "
                            "them)")
    if ck.resume_from_checkpoint and ck.overwrite_output_dir:
        raise SageGRPOError("--overwrite_output_dir deletes what --resume_from_checkpoint would continue; pass one")
    check_report_to(cfg.logging.report_to)
    # on the device init_distributed will pick (this rank's GPU whenever there is one), in the compute dtype, with
    # its backward; "auto" touches no device
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else "cpu"
    check_attention_backend(cfg.model.attention_backend, device, torch_dtype(cfg.model.dtype), training=True)
    if cfg.model.fp8_matmul:  # FP8 tensor cores on that device
        from sage_grpo.models.fp8 import check_fp8_matmul

        check_fp8_matmul(torch.device(device))
    # every missing file (prompt files, reference images, the HunyuanVideo-1.5 checkpoint, the rewards' models) and
    # missing package is gathered and said in one message, so that a launch without weights fails once, not once per
    # missing piece
    problems: list[str] = []

    def gather(fn, *args):
        try:
            return fn(*args)
        except SageGRPOError as e:
            problems.append(str(e))
            return None

    prompts = gather(read_prompts, cfg.data.train_video_csv)  # one task per file (sage_grpo.data)
    val_records = spec = None
    if prompts is not None:
        val_records = gather(load_validation_records, cfg, prompts)
        gather(check_reference_images, prompts, f"--train_video_csv {cfg.data.train_video_csv}")  # images decode
    if val_records is not None:
        spec = gather(validation_metrics_spec, cfg, val_records)
        gather(check_reference_images, val_records, "validation prompts")
    m = cfg.model
    where = (m.pretrained_model_root, m.model_path, m.pretrained_transformer_version)
    if m.model_path and Path(m.model_path) == Path(TINY_CHECKPOINT_DIR):  # the tiny default is built in setup
        try:
            loc = locate_model(*where)
        except SageGRPOError:
            loc = None
    else:
        loc = gather(locate_model, *where)
    if loc is not None and val_records is not None:
        gather(check_prompt_tasks, cfg, loc.task, prompts, val_records)
        # before the sampler settings and the run's config are built: the checkpoint's shift and CFG scale
        gather(resolve_checkpoint_defaults, cfg, loc)
    # an import path is imported here: a typo is one line, early; so is a package a reward needs and lacks (its
    # builder's check_installed) and a model file it would not find (its check_files), before the run folder is
    # made and any model loads, for the rewards trained on and those setup builds for validation
    v = cfg.validation
    validates = bool(v.validation_interval) or v.validate_at_step0
    names = [*cfg.reward.reward_model.split(","), *(spec.rewards if validates and spec is not None else ())]
    for name in names:
        builder = gather(get_reward_builder, name)
        check = getattr(builder, "check_installed", None)
        if check is not None:
            gather(check)
    problems += [p for p in gather(missing_reward_files, cfg, names) or () if p not in problems]
    if len(problems) == 1:
        raise SageGRPOError(problems[0])
    if problems:
        raise SageGRPOError(f"{len(problems)} things to fix before the run can start:\n  - "
                            + "\n  - ".join(p.replace("\n", "\n    ") for p in problems))
    if device != "cpu":  # on a GPU, the run's memory plan against its memory, before any model loads (one line)
        from sage_grpo.memory import check_device_memory

        check_device_memory(cfg, world_size, device)


def check_resume_fits(cfg: Config, path: Path) -> None:
    """A full fine-tuning checkpoint resumed with --use_lora (or a LoRA one without it) is refused here, before any
    model loads: otherwise the load fails only once the models are up, in a loader's words (a full run's checkpoint
    has no lora/ adapter; a LoRA run's optimizer state holds the adapter's parameters, not the transformer's). So is
    a checkpoint inside an accumulation resumed with --gradient_accumulation_steps no greater than its pending rounds
    (the update would never be taken)."""
    from sage_grpo.checkpoint import read_train_state

    state = read_train_state(path)
    saved = bool(state["config"]["model"]["use_lora"])
    pending, accum = int(state.get("accum_rounds", 0)), cfg.optim.gradient_accumulation_steps
    if pending and pending >= accum:  # the pending update would never be taken (it is taken at accum rounds)
        raise SageGRPOError(f"{path} holds {pending} accumulated round(s) of an update; --gradient_accumulation_steps "
                            f"{accum} would never take it: resume with --gradient_accumulation_steps > {pending} "
                            f"(the saved run's is {state['config']['optim']['gradient_accumulation_steps']})")
    if saved != cfg.model.use_lora:
        def kind(lora: bool) -> str:
            return "a LoRA run" if lora else "a full fine-tuning run"

        raise SageGRPOError(f"{path} is {kind(saved)} (use_lora {saved}) but this run is {kind(cfg.model.use_lora)} "
                            f"(--use_lora {cfg.model.use_lora}): resume it with --use_lora {saved}, or start a new "
                            "run in another --output_dir")


def agreed_resume(cfg: Config, info: DistInfo) -> Path | None:
    """`--resume_from_checkpoint` resolved once, on rank 0, and broadcast: on a shared filesystem a node with a
    stale directory listing would otherwise load an older checkpoint than the others (collective)."""
    from sage_grpo.checkpoint import resolve_resume
    from sage_grpo.parallel.dist import broadcast_object

    path, error = None, None
    if info.is_main:
        try:
            path = resolve_resume(cfg.checkpoint.resume_from_checkpoint, cfg.checkpoint.output_dir)
        except SageGRPOError as e:
            error = str(e)
    path, error = broadcast_object((None if path is None else str(path), error))
    if error is not None:
        raise SageGRPOError(error)
    return None if path is None else Path(path)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    run_cli(main)
