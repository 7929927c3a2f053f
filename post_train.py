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
`update_ref_model_step` updates. Validation samples ODE videos; checkpoints resume exactly.

    python post_train.py --config configs/tiny_cpu.yaml                          # tiny model, one CPU process
    torchrun --nproc_per_node 8 post_train.py --config configs/single_node_8gpu.yaml   # FSDP2 + Ulysses sp 2
    bash run_post_train.sh                                                       # the same, with AUTO_RESUME=1
    NNODES=8 NODE_RANK=... MASTER_ADDR=... bash run_post_train_multinode.sh     # 64 GPUs, c10d rendezvous
"""

from __future__ import annotations

import copy
import math
import signal
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from sage_grpo.config import Config, config_to_dict, dump_yaml, load_config, parse_size, torch_dtype, validate
from sage_grpo.errors import SageGRPOError, run_cli


def print0(info, *args) -> None:
    if info.is_main:
        print("[post_train]", *args, flush=True)


# ------------------------------------------------------------------------------------------------------ setup


@dataclass
class Run:
    """Everything the phases share. Counters: `step` = rollout rounds done, `updates` = optimizer updates done."""

    cfg: Config
    info: object
    out: Path
    pipe: object
    transformer: torch.nn.Module
    optimizer: object
    trainable: list
    anchor: object
    controller: object
    reward: object
    cache: object
    sampler: object
    prompts: list
    val_records: list
    settings: object
    val_settings: object
    shape: tuple
    val_shape: tuple
    step_weights: torch.Tensor
    variance: torch.Tensor
    logger: object = None
    step: int = 0
    updates: int = 0
    accum_rounds: int = 0  # rounds accumulated into the pending update
    skipped_updates: int = 0  # updates dropped for a non-finite gradient norm or no valid pair (whole run)
    failed_reward_steps: int = 0  # steps without a single finite reward (whole run)
    failed_streak: int = 0  # ... in a row, up to now
    stats: dict = field(default_factory=dict)


class Anchor:
    """The reference pi_ref of KL_pos. Full fine-tuning: a frozen copy (on CPU between uses with
    `reference_mode_offload`). LoRA: never a second model: the fixed anchor is the base with the adapter disabled,
    the moving anchor a second set of adapter weights swapped into the adapter for its forwards.
    `synced`: the anchor equals the current policy (initial, or just refreshed, and no update since)."""

    def __init__(self, transformer, cfg: Config, info):
        from sage_grpo.kl import uses_position_kl

        self.uses_pos = uses_position_kl(cfg.kl)
        self.moving = cfg.kl.use_moving_KL and self.uses_pos
        self.every = cfg.kl.update_ref_model_step
        self.offload = cfg.kl.reference_mode_offload
        self.lora = cfg.model.use_lora
        self.device = info.device
        self.sharded = None  # the FSDP2 anchor (full fine-tuning under FSDP2): offload is FSDP2's own
        self.transformer = transformer
        self.synced = True
        self.refreshed_at = 0  # optimizer update of the last refresh (0 = the initial model)
        self.model = None
        self.adapter: dict[str, torch.Tensor] | None = None
        if not self.uses_pos:
            return
        if self.lora:
            if self.moving:
                from sage_grpo.models.lora import adapter_parameters
                from sage_grpo.parallel.fsdp import clone_local_shards

                self.adapter = clone_local_shards(adapter_parameters(transformer))
        elif uses_fsdp(cfg, info):
            from sage_grpo.parallel.fsdp import ShardedAnchor
            from sage_grpo.parallel.ulysses import enable_sequence_parallel

            self.sharded = ShardedAnchor(transformer, info, param_dtype=torch_dtype(cfg.model.dtype),
                                         offload=self.offload)
            self.model = enable_sequence_parallel(self.sharded.module, info.sp_group)
        else:
            self.model = copy.deepcopy(transformer).requires_grad_(False).eval()
            if self.offload:
                self.model.to("cpu")

    def due(self, updates: int) -> bool:
        return self.moving and updates - self.refreshed_at >= self.every

    @torch.no_grad()
    def refresh(self, updates: int) -> None:
        """Copy the policy into the anchor (parameter to parameter: each rank its own shards under FSDP2, no
        collective, no full tensor)."""
        from sage_grpo.parallel.fsdp import copy_local_shards_

        if self.lora:
            from sage_grpo.models.lora import adapter_parameters

            live = adapter_parameters(self.transformer)
            copy_local_shards_([self.adapter[k] for k in live], list(live.values()))
        elif self.sharded is not None:
            self.sharded.refresh()
        else:
            copy_local_shards_(list(self.model.parameters()), list(self.transformer.parameters()))
        self.refreshed_at, self.synced = updates, True

    @contextmanager
    def active(self):
        """Within: `self.module` computes the anchor's forward."""
        if self.lora and not self.moving:
            self.transformer.disable_adapters()
            try:
                yield self.transformer
            finally:
                self.transformer.enable_adapters()
        elif self.lora:
            from sage_grpo.models.lora import adapter_parameters
            from sage_grpo.parallel.fsdp import clone_local_shards, copy_local_shards_

            live = adapter_parameters(self.transformer)
            saved = clone_local_shards(live)
            copy_local_shards_(list(live.values()), [self.adapter[k] for k in live])
            try:
                yield self.transformer
            finally:
                copy_local_shards_(list(live.values()), [saved[k] for k in live])
        else:
            move = self.offload and self.sharded is None  # FSDP2 brings offloaded shards to the device itself
            if move:
                self.model.to(self.device)
            try:
                yield self.model
            finally:
                if move:
                    self.model.to("cpu")

    def state(self) -> dict:
        return {"synced": self.synced, "refreshed_at": self.refreshed_at}

    @property
    def is_initial(self) -> bool:
        return self.refreshed_at == 0


def uses_fsdp(cfg: Config, info) -> bool:
    """FSDP2 shards the policy when asked and there is more than one process (one process trains unsharded)."""
    return cfg.parallel.enable_fsdp and info.distributed


def load_policy(cfg: Config, info):
    """-> (pipeline, transformer, trainable parameters). Under FSDP2 the transformer is built on the meta device,
    sharded per block then at the root, and each rank reads only its rows of the weights (no rank ever holds the
    whole model); otherwise the whole model is loaded and the LoRA adapter (if any) injected."""
    from sage_grpo.models.loading import load_pipeline, locate_model
    from sage_grpo.models.lora import setup_trainable
    from sage_grpo.parallel.ulysses import enable_sequence_parallel

    m = cfg.model
    dtype = torch_dtype(m.dtype)
    lora = dict(use_lora=m.use_lora, lora_r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
                lora_target_modules=m.lora_target_modules, pretrained_lora_path=m.pretrained_lora_path)
    if uses_fsdp(cfg, info):
        from sage_grpo.parallel.fsdp import load_sharded_transformer

        # the velocity the root returns is a view; predict_velocity never modifies it in place, which is what
        # this FSDP2 warning is about
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

        loc = locate_model(m.pretrained_model_root, m.model_path, m.pretrained_transformer_version)
        if loc.layout != "diffusers":
            raise SageGRPOError(f"--enable_fsdp loads the diffusers layout only; convert {loc.root} first with "
                                "scripts/convert_authors_checkpoint.py, or pass --enable_fsdp False")
        torch.manual_seed(cfg.optim.seed)  # the LoRA A matrices: drawn exactly as the unsharded path draws them
        transformer, trainable = load_sharded_transformer(
            loc.root / "transformer", info, master_dtype=torch_dtype(m.master_weight_type), param_dtype=dtype,
            lora=lora, gradient_checkpointing=m.enable_gradient_checkpointing)
        pipe = load_pipeline(m.pretrained_model_root, m.model_path, m.pretrained_transformer_version, dtype=dtype,
                             device=info.device, transformer=transformer)
    else:
        pipe = load_pipeline(m.pretrained_model_root, m.model_path, m.pretrained_transformer_version, dtype=dtype,
                             transformer_dtype=torch_dtype(m.master_weight_type), device=info.device)
        transformer = pipe.transformer
        torch.manual_seed(cfg.optim.seed)  # the LoRA A matrices are drawn from the global generator
        trainable = setup_trainable(transformer, **lora)
        if m.enable_gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
    # Ulysses inside each sp group: full inputs and outputs on every sp rank, partial gradients (summed over sp by
    # FSDP2's divide factor dp, or by `sync_gradients`)
    enable_sequence_parallel(transformer, info.sp_group)
    return pipe, transformer, trainable


def sync_gradients(params: list, info, fsdp: bool) -> None:
    """Sum the gradients over all ranks and divide by dp: the mean over data-parallel ranks of the sp groups' sums
    (every rank calls it with the same parameters). FSDP2 already reduce-scattered them during backward."""
    if not info.distributed or fsdp:
        return
    from sage_grpo.parallel.dist import all_reduce_sum

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        all_reduce_sum(p.grad).div_(info.dp_size)


def load_validation_records(cfg: Config, prompts: list) -> list:
    from sage_grpo.data import PromptRecord, read_prompts

    v = cfg.validation
    if v.valid_video_csv:
        return read_prompts(v.valid_video_csv)
    if v.validation_prompts:
        return [PromptRecord(prompt=p, index=i) for i, p in enumerate(v.validation_prompts)]
    return list(prompts[: min(4, len(prompts))])


def setup(cfg: Config, info, resume: Path | None) -> Run:
    from sage_grpo.cli import check_writable_dir
    from sage_grpo.data import GroupSampler, read_prompts
    from sage_grpo.equalizer import equalizer_weights
    from sage_grpo.kl import AdaptiveKLController
    from sage_grpo.metrics import check_report_to
    from sage_grpo.models.text_cache import TextEmbeddingCache
    from sage_grpo.models.tiny_checkpoint import ensure_tiny_checkpoint
    from sage_grpo.optim import build_optimizer
    from sage_grpo.rewards import build_reward_from_config
    from sage_grpo.rollout import SamplerSettings, latent_shape
    from sage_grpo.schedule import sigma_schedule
    from sage_grpo.sde import step_variance

    m, r = cfg.model, cfg.rollout
    check_report_to(cfg.logging.report_to if info.is_main else "none")
    out = check_writable_dir(cfg.checkpoint.output_dir, "--output_dir")  # a private probe file per rank
    prompts = read_prompts(cfg.data.train_video_csv)
    val_records = load_validation_records(cfg, prompts)
    ensure_tiny_checkpoint(cfg.model.model_path, is_main=info.is_main, log=lambda msg: print0(info, msg))

    dtype = torch_dtype(m.dtype)
    pipe, transformer, trainable = load_policy(cfg, info)
    if m.vae_tiling:
        pipe.vae.enable_tiling()
    optimizer = build_optimizer([(n, p) for n, p in transformer.named_parameters() if p.requires_grad], cfg.optim)
    anchor = Anchor(transformer, cfg, info)

    # every prompt the run will use, encoded once (a prompt missed here is still encoded on first use)
    cache = TextEmbeddingCache(pipe, info.device, dtype, m.text_embedding_cache_dir or None)
    v = cfg.validation
    validates = bool(v.validation_interval) or v.validate_at_step0
    needed = [p.prompt for p in prompts] + ([rec.prompt for rec in val_records] if validates else [])
    if r.cfg_scale != 1.0 or (validates and v.validation_guidance_scale != 1.0):
        needed.append(r.neg_prompt)
    cache.precompute(needed)
    if m.offload_text_encoder:
        cache.offload_encoders()

    settings = SamplerSettings.from_config(cfg)
    sigmas = sigma_schedule(r.grpo_sampling_steps, r.flow_shift)
    variance = step_variance(r.sde_type, sigmas[:-1], sigmas[1:], r.eta, sigma_max=sigmas[1], sage_clamp=r.sage_sigma_clamp)
    s_t = (equalizer_weights(r.sde_type, sigmas, r.eta, cps_logprob=r.cps_logprob, sage_clamp=r.sage_sigma_clamp)
           if cfg.optim.use_grad_balancing else torch.ones(r.grpo_sampling_steps))
    vh, vw = parse_size(v.validation_fixed_size, "--validation_fixed_size")
    val_settings = SamplerSettings(sde_type="ode", eta=0.0, num_steps=v.validation_num_inference_steps,
                                   shift=v.validation_timestep_shift, cfg_scale=v.validation_guidance_scale,
                                   compute_dtype=dtype, autocast=settings.autocast, master_dtype=settings.master_dtype)
    run = Run(
        cfg=cfg, info=info, out=out, pipe=pipe, transformer=transformer, optimizer=optimizer, trainable=trainable,
        anchor=anchor, controller=AdaptiveKLController.from_config(cfg.kl),
        reward=build_reward_from_config(cfg, info.device), cache=cache,
        sampler=GroupSampler(len(prompts), batch_size=cfg.data.batch_size, num_generations=cfg.data.num_generations,
                             dp_size=info.dp_size, seed=cfg.optim.seed),
        prompts=prompts, val_records=val_records, settings=settings, val_settings=val_settings,
        shape=latent_shape(pipe.vae.config, r.sample_n_frames, r.height, r.width),
        val_shape=latent_shape(pipe.vae.config, v.validate_video_length, vh, vw),
        step_weights=s_t.float(), variance=variance.float(),
    )
    if resume is not None:
        load_checkpoint(run, resume)
    return run


# ------------------------------------------------------------------------------------------------------ phases


@dataclass
class Round:
    """One rollout round on this rank. b = batch_size videos."""

    traj: object
    rewards: dict  # component -> [b] (this rank)
    advantages: torch.Tensor  # [b]
    valid: torch.Tensor  # [b] bool
    plan: torch.Tensor  # [b, k] trained diffusion steps per sample
    metrics: dict


def rollout_phase(run: Run):
    """Sample this rank's videos of the next step -> (trajectory, the step's global group ids of my videos)."""
    from sage_grpo.rollout import rollout
    from sage_grpo.seeding import derive_seed, prompt_noise_seed

    cfg, info = run.cfg, run.info
    step_prompts = run.sampler.next_step()
    mine = run.sampler.rank_slice(step_prompts, info.dp_rank)  # [(group, prompt index, generation)]
    recs = [run.prompts[p] for _, p, _ in mine]
    texts = [rec.prompt for rec in recs]
    cond = run.cache.get(texts)
    uncond = run.cache.get([cfg.rollout.neg_prompt] * len(texts)) if run.settings.use_cfg else None
    run.transformer.eval()  # no LoRA dropout while sampling: the stored log-probs are the deterministic policy's
    traj = rollout(
        run.transformer, cond, uncond, prompts=texts, prompt_ids=torch.tensor([g for g, _, _ in mine]),
        generation_ids=torch.tensor([gen for _, _, gen in mine]),
        prompt_seeds=torch.tensor([prompt_noise_seed(rec.prompt, rec.seed, rec.index) for rec in recs]),
        latent_shape=run.shape, settings=run.settings, image_tokens=run.pipe.vision_num_semantic_tokens,
        base_seed=derive_seed(cfg.optim.seed, run.step), same_noise=cfg.rollout.use_same_noise,
        storage_dtype=torch.float32, show_progress=info.is_main, chunk_size=cfg.optim.mini_batch_size_per_update,
        device=info.device,
    )
    return traj


def score_videos(run: Run, traj) -> tuple[list[str], torch.Tensor]:
    """Decode and score this data-parallel rank's videos -> (component names, [b, K] scores), each video decoded and
    scored once per sequence-parallel group: the sp peers hold the same b videos, each takes a contiguous share,
    and the shares are all-gathered inside the group."""
    from sage_grpo.parallel.dist import all_gather_cat
    from sage_grpo.rollout import decode_latents

    info, b = run.info, traj.batch_size
    names = sorted(["total", *run.reward.components])
    share = -(-b // info.sp_size)  # ceil(b / sp) rows per sp rank; the last ranks may get fewer (or none)
    lo, hi = min(info.sp_rank * share, b), min((info.sp_rank + 1) * share, b)
    mine = torch.full((share, len(names)), math.nan, device=info.device)  # [share, K], NaN rows = padding
    if hi > lo:
        frames = decode_latents(run.pipe.vae, traj.final_latents[lo:hi])  # [n, F, 3, H, W] in [0, 1]
        scores = run.reward(frames, traj.prompts[lo:hi])  # {"total": [n], component: [n]}
        mine[: hi - lo] = torch.stack([scores[k].float().to(info.device) for k in names], dim=1)
    if info.sp_size > 1:
        mine = all_gather_cat(mine, group=info.sp_group)  # [sp * share, K]
    return names, mine[:b]


def reward_phase(run: Run, traj) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Score, gather the rewards of all data-parallel ranks (a group may span several), group-relative advantages
    -> (my advantages [b], my valid [b], metrics)."""
    from sage_grpo.advantage import group_advantages
    from sage_grpo.parallel.dist import all_gather_cat

    cfg, info = run.cfg, run.info
    names, mine = score_videos(run, traj)  # [b, K]
    # over the ranks with my sp_rank: one copy of each data-parallel rank's videos, in dp-rank order
    every = all_gather_cat(mine, group=info.dp_group)  # [B_global, K]
    groups = all_gather_cat(traj.prompt_ids.to(info.device), group=info.dp_group)  # [B_global]
    total = every[:, names.index("total")].cpu()
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


def plan_round(run: Run, traj) -> torch.Tensor:
    """The trained steps of each of my samples -> [b, k], from generators seeded by (seed, step, video)."""
    from sage_grpo.grpo import plan_steps
    from sage_grpo.seeding import derive_seed

    cfg, b = run.cfg, traj.batch_size
    first = run.info.dp_rank * b
    gens = [torch.Generator().manual_seed(derive_seed(cfg.optim.seed, run.step, first + i, 0x7E5)) for i in range(b)]
    return plan_steps(b, run.variance, cfg.optim.timestep_fraction, cfg.optim.enable_timestep_permutation, gens)


def micro_batches_of(run: Run, plan: torch.Tensor) -> list[list]:
    """Micro-batches per optimizer update of this round: the rollout's chunks, split over updates_per_rollout."""
    from sage_grpo.grpo import micro_batches

    chunks = list(torch.arange(plan.shape[0]).split(run.cfg.optim.mini_batch_size_per_update))
    per_update = len(chunks) // run.cfg.optim.updates_per_rollout
    return [micro_batches(plan, chunks[u * per_update : (u + 1) * per_update])
            for u in range(run.cfg.optim.updates_per_rollout)]


def anchor_means(run: Run, traj, batches: list) -> None:
    """kl_compute_mode rollout_phase: the anchor's means of every planned pair, right after the rollout, kept on
    CPU (skipped when the anchor equals the rollout policy: the update then uses the policy's own means)."""
    from sage_grpo.rollout import policy_step

    if not run.anchor.uses_pos or run.anchor.synced or run.cfg.kl.kl_compute_mode != "rollout_phase":
        return
    with run.anchor.active() as model, torch.no_grad():
        for mbs in batches:
            for mb in mbs:
                mb.ref_mean = policy_step(model, traj, mb.samples, mb.steps, run.pipe.vision_num_semantic_tokens).mean.cpu()
                run.stats["anchor_forwards"] = run.stats.get("anchor_forwards", 0) + len(mb.samples)


def update_phase(run: Run, traj, adv, valid, batches: list, metrics: dict) -> None:
    """Backpropagate the round's GRPO loss; take the optimizer step(s) when an update is complete."""
    from sage_grpo.grpo import UpdateStats, grpo_backward
    from sage_grpo.kl import kl_term_weights
    from sage_grpo.parallel.dist import all_reduce_sum
    from sage_grpo.rollout import policy_step

    cfg, info = run.cfg, run.info
    beta_pos, beta_vel = kl_term_weights(cfg.kl)
    if not run.anchor.uses_pos:
        beta_pos = 0.0
    tokens = run.pipe.vision_num_semantic_tokens
    run.transformer.train()

    def step_fn(i, t):
        return policy_step(run.transformer, traj, i, t, tokens)

    def anchor_fn(mb):
        with run.anchor.active() as model:
            run.stats["anchor_forwards"] = run.stats.get("anchor_forwards", 0) + len(mb.samples)
            return policy_step(model, traj, mb.samples, mb.steps, tokens).mean

    accum = cfg.optim.gradient_accumulation_steps
    total = UpdateStats()
    for mbs in batches:
        pairs = sum(int(valid[mb.samples].sum()) for mb in mbs)
        n_global = float(all_reduce_sum(torch.tensor(float(pairs), device=info.device), group=info.dp_group))
        # mean over the valid pairs of all ranks (gradients are averaged over ranks) and of the accumulated rounds
        normalizer = max(n_global, 1.0) / info.dp_size * accum
        stats = UpdateStats()
        for mb in mbs:
            stats.merge(grpo_backward(
                mb, step_fn, logp_old=traj.log_probs, advantages=adv, valid=valid, step_weights=run.step_weights,
                clip_range=cfg.optim.clip_range, normalizer=normalizer, kl_coef=run.controller.value,
                beta_pos=beta_pos, beta_vel=beta_vel, anchor_fn=anchor_fn, anchor_is_policy=run.anchor.synced,
            ))
            run.stats["update_forwards"] = run.stats.get("update_forwards", 0) + len(mb.samples)
        total.merge(stats)
        run.stats.setdefault("kl_sum", 0.0)
        run.stats["kl_sum"] += stats.sums.get("kl/loss", 0.0)
        run.stats["kl_pairs"] = run.stats.get("kl_pairs", 0) + stats.pairs
        run.accum_rounds += 1 if cfg.optim.updates_per_rollout == 1 else 0
        if cfg.optim.updates_per_rollout == 1 and run.accum_rounds < accum:
            continue
        optimizer_step(run, metrics)
    metrics.update(total.summary())
    metrics["train/masked_pairs"] = total.masked_pairs


def optimizer_step(run: Run, metrics: dict) -> None:
    """Sync, clip, step, count; then the KL controller moves with the rank-averaged L_KL of the update."""
    from sage_grpo.optim import clip_grad_norm, lr_at
    from sage_grpo.parallel.dist import all_reduce_sum

    cfg, info = run.cfg, run.info
    sync_gradients(run.trainable, info, uses_fsdp(cfg, info))
    norm = clip_grad_norm(run.trainable, cfg.optim.max_grad_norm)  # identical on every rank after the all-reduce
    lr = lr_at(run.updates, cfg.optim.learning_rate, cfg.optim.warmup_steps)
    kl = all_reduce_sum(torch.tensor([run.stats.pop("kl_sum", 0.0), float(run.stats.pop("kl_pairs", 0))],
                                     dtype=torch.float64, device=info.device), group=info.dp_group)
    # the same on every rank: the norm after the all-reduce, the pair count after its all-reduce
    if math.isfinite(norm) and kl[1] > 0:
        run.optimizer.set_lr(lr)
        run.optimizer.step()
        run.updates += 1
        run.anchor.synced = False
        metrics["train/skipped_update"] = 0
    else:  # NaN/inf loss or gradients, or no valid pair: every rank skips, no divergent collectives
        metrics["train/skipped_update"] = 1
        run.skipped_updates += 1
    metrics["train/skipped_updates_total"] = run.skipped_updates
    run.optimizer.zero_grad(set_to_none=True)
    run.accum_rounds = 0
    l_kl = float(kl[0] / kl[1]) if kl[1] > 0 else math.nan
    if cfg.kl.kl_weight > 0:
        metrics["kl/coef"] = run.controller.value  # the coefficient this update used
        if metrics["train/skipped_update"] == 0:
            run.controller.update(l_kl)
    metrics["train/grad_norm"] = norm
    metrics["train/lr"] = lr


def validation(run: Run, step: int) -> dict:
    """ODE videos of the validation prompts (split over ranks) -> output_dir/samples/step_{step:06d}/, scored."""
    from sage_grpo.generation import sample_stem, sample_videos, write_sample
    from sage_grpo.parallel.dist import all_reduce_sum

    cfg, info = run.cfg, run.info
    folder = run.out / "samples" / f"step_{step:06d}"
    # prompts split over data-parallel ranks (sp peers make each video together); every rank runs the same number
    # of forwards, since FSDP2 and Ulysses forwards are collective: short ranks repeat a prompt and discard it
    per_rank = -(-len(run.val_records) // info.dp_size)
    mine = run.val_records[info.dp_rank :: info.dp_size]
    todo = mine + [run.val_records[0]] * (per_rank - len(mine))
    sums = torch.zeros(2, dtype=torch.float64, device=info.device)
    for j, (rec, frames) in enumerate(sample_videos(
            run.pipe, run.cache, todo, settings=run.val_settings, shape=run.val_shape,
            base_seed=cfg.validation.validation_seed, negative_prompt=cfg.rollout.neg_prompt,
            show_progress=info.is_main, decode=info.sp_rank == 0)):
        if j >= len(mine) or info.sp_rank != 0:  # padding, or an sp peer's copy: the sp leader writes and scores
            continue
        score = run.reward(frames[None].to(info.device), [rec.prompt])
        total = float(score["total"][0])
        write_sample(folder / f"{sample_stem(rec)}.mp4", frames, prompt=rec.prompt, fps=cfg.rollout.video_fps,
                     meta={"step": step, "reward": {k: float(v[0]) for k, v in score.items()}})
        if math.isfinite(total):
            sums += torch.tensor([total, 1.0], dtype=torch.float64, device=info.device)
    sums = all_reduce_sum(sums)  # every rank joins, sp peers add zeros
    return {"val/reward_total": float(sums[0] / sums[1]) if sums[1] > 0 else math.nan, "val/videos": int(sums[1])}


# ------------------------------------------------------------------------------------------------------ checkpoints


def train_state(run: Run) -> dict:
    return {
        "step": run.step, "updates": run.updates, "controller": run.controller.state_dict(),
        "sampler": run.sampler.state_dict(), "anchor": run.anchor.state(),
        "skipped_updates": run.skipped_updates, "failed_reward_steps": run.failed_reward_steps,
        "failed_streak": run.failed_streak, "world_size": run.info.world_size, "config": config_to_dict(run.cfg),
    }


def save(run: Run) -> Path:
    """Write checkpoint-{step} (collective). A failed write (disk full, read-only) ends the run with one message;
    the older checkpoints are untouched."""
    from sage_grpo.checkpoint import CheckpointWriteError, list_checkpoints

    try:
        path = write_checkpoint(run)
    except CheckpointWriteError as err:
        done = list_checkpoints(run.cfg.checkpoint.output_dir)
        last = f"the last complete one is {done[-1][1]}" if done else "no complete checkpoint exists yet"
        raise SageGRPOError(f"{err}; {last}. Free space or fix the permissions of --output_dir, then resume with "
                            "--resume_from_checkpoint latest") from None
    print0(run.info, f"checkpoint {path}")
    return path


def write_checkpoint(run: Run) -> Path:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from sage_grpo.checkpoint import save_checkpoint
    from sage_grpo.models.lora import merged_state_dict, save_lora
    from sage_grpo.parallel.fsdp import gather_full, sharded_lora_state

    fsdp, lora = uses_fsdp(run.cfg, run.info), run.cfg.model.use_lora
    a = run.anchor
    anchor_state = None if (a.model is None or a.is_initial) else get_model_state_dict(a.model)  # DTensors under FSDP2
    # small: gathered whole under FSDP2 (collective, every rank), then rank 0 writes it
    anchor_lora = None if (a.adapter is None or a.is_initial) else gather_full(a.adapter)
    lora_state = sharded_lora_state(run.transformer) if (fsdp and lora) else None  # collective, before rank 0 writes
    return save_checkpoint(
        run.cfg.checkpoint.output_dir, run.step, rank=run.info.rank,
        model_state=merged_state_dict(run.transformer),
        optimizer_state=get_optimizer_state_dict(run.transformer, run.optimizer.optimizers),
        train_state=train_state(run),
        lora_writer=(lambda d: save_lora(run.transformer, d, state=lora_state)) if lora else None,
        anchor_state=anchor_state, anchor_lora=anchor_lora, total_limit=run.cfg.checkpoint.checkpoints_total_limit,
    )


def load_checkpoint(run: Run, path: Path) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from sage_grpo.checkpoint import dcp_load, exactness_diff, load_rng_state, read_train_state
    from sage_grpo.models.lora import load_lora
    from sage_grpo.parallel.fsdp import copy_full_into_shards_, load_lora_sharded

    state = read_train_state(path)
    diffs = exactness_diff(state["config"], config_to_dict(run.cfg))
    if diffs:
        print0(run.info, "resuming with settings that differ from the saved run (the continuation is not exact): "
               + "; ".join(diffs))
    fsdp = uses_fsdp(run.cfg, run.info)
    if run.cfg.model.use_lora:
        (load_lora_sharded if fsdp else load_lora)(run.transformer, path / "lora")
    else:
        model = {"model": get_model_state_dict(run.transformer)}
        dcp_load(model, path / "transformer", "transformer weights")
        set_model_state_dict(run.transformer, model["model"])
    opt = {"optimizer": get_optimizer_state_dict(run.transformer, run.optimizer.optimizers)}
    dcp_load(opt, path / "optimizer", "optimizer state")
    set_optimizer_state_dict(run.transformer, run.optimizer.optimizers, opt["optimizer"])
    a = run.anchor
    a.synced, a.refreshed_at = bool(state["anchor"]["synced"]), int(state["anchor"]["refreshed_at"])
    if a.model is not None and not a.is_initial:
        anchor = {"model": get_model_state_dict(a.model)}
        dcp_load(anchor, path / "anchor", "anchor weights")
        set_model_state_dict(a.model, anchor["model"])
    if a.adapter is not None and not a.is_initial:
        copy_full_into_shards_(a.adapter, load_file(path / "anchor_lora.safetensors"))  # plain tensors: a copy
    run.controller.load_state_dict(state["controller"])
    run.sampler.load_state_dict(state["sampler"])
    run.step, run.updates = int(state["step"]), int(state["updates"])
    run.skipped_updates = int(state.get("skipped_updates", 0))
    run.failed_reward_steps, run.failed_streak = int(state.get("failed_reward_steps", 0)), int(state.get("failed_streak", 0))
    load_rng_state(path, run.info.rank)
    print0(run.info, f"resumed from {path} at step {run.step} ({run.updates} optimizer updates)")


# ------------------------------------------------------------------------------------------------------ main


def peak_memory_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB -> GiB (peak RSS)


def main(argv: list[str] | None = None) -> Path:
    import os

    from sage_grpo.checkpoint import resolve_resume
    from sage_grpo.metrics import MetricsLogger, plot_curves
    from sage_grpo.parallel.dist import barrier, destroy, init_distributed

    cfg = load_config(argv, prog="post_train.py", description=__doc__)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world_size=world)
    resume = resolve_resume(cfg.checkpoint.resume_from_checkpoint, cfg.checkpoint.output_dir)
    info = init_distributed(cfg.parallel.sp_size, cfg.parallel.dp_replicate)
    try:
        run = setup(cfg, info, resume)
        if info.is_main:
            dump_yaml(cfg, run.out / "config.yaml")
            run.logger = MetricsLogger(run.out, report_to=cfg.logging.report_to, run_name=cfg.logging.run_name,
                                       project=cfg.logging.wandb_project, config=config_to_dict(cfg),
                                       resume_step=run.step if resume is not None else None)
        train(run)
        barrier()  # every rank done before any closes its connections (gloo aborts a peer still using them)
    finally:
        destroy()
    if info.is_main:
        run.logger.close()
        plot_curves(run.out / "metrics.jsonl", run.out / "curves.png")
    return run.out


def train(run: Run) -> None:
    from sage_grpo.metrics import plot_curves
    from sage_grpo.parallel.dist import mean_metrics

    cfg, info = run.cfg, run.info
    v, ck = cfg.validation, cfg.checkpoint
    if v.validate_at_step0 and run.step == 0:
        log(run, 0, validation(run, 0))
    last_saved = run.step
    bar = tqdm(total=cfg.optim.max_steps, initial=run.step, desc="steps", disable=not info.is_main)
    with StopRequest() as stop:
        while run.step < cfg.optim.max_steps:
            t0 = time.perf_counter()
            if run.accum_rounds == 0 and run.anchor.due(run.updates):
                run.anchor.refresh(run.updates)
            metrics: dict = {"kl/anchor_synced": int(run.anchor.synced)}
            traj = rollout_phase(run)
            t1 = time.perf_counter()
            adv, valid, m = reward_phase(run, traj)
            metrics.update(m)
            t2 = t3 = time.perf_counter()
            # no finite reward on any rank (every rank sees the gathered rewards, so all agree): nothing to learn
            if m["reward/failed"] == m["reward/videos"]:
                run.failed_reward_steps += 1
                run.failed_streak += 1
            else:
                run.failed_streak = 0
                batches = micro_batches_of(run, plan_round(run, traj))
                anchor_means(run, traj, batches)
                t3 = time.perf_counter()
                update_phase(run, traj, adv, valid, batches, metrics)
            t4 = time.perf_counter()
            run.step += 1
            metrics["train/updates"] = run.updates
            metrics["train/failed_reward_steps"] = run.failed_reward_steps
            metrics.update({"perf/rollout_s": t1 - t0, "perf/reward_s": t2 - t1, "perf/anchor_s": t3 - t2,
                            "perf/update_s": t4 - t3, "perf/step_s": t4 - t0,
                            "mem/peak_gib": peak_memory_gib(info.device)})
            if v.validation_interval and run.step % v.validation_interval == 0:
                metrics.update(validation(run, run.step))
                if info.is_main:
                    plot_curves(run.out / "metrics.jsonl", run.out / "curves.png")
            if run.step % cfg.logging.log_interval == 0 or run.step == cfg.optim.max_steps:
                log(run, run.step, mean_metrics(metrics))  # collective: every rank reaches it at the same steps
            bar.update(1)
            if ck.save_interval and run.step % ck.save_interval == 0:
                save(run)
                last_saved = run.step
            limit = cfg.reward.max_failed_reward_steps
            if limit and run.failed_streak >= limit:
                if last_saved != run.step:
                    save(run)
                raise SageGRPOError(
                    f"no finite reward in the last {run.failed_streak} steps (--max_failed_reward_steps {limit}); "
                    f"checkpoint-{run.step} is saved. Check the reward model (paths, --reward_dtype, "
                    "--reward_max_pixels) and resume with --resume_from_checkpoint latest")
            if stop.agreed(info.device):
                if last_saved != run.step:
                    save(run)
                    last_saved = run.step
                print0(info, f"stopped by {stop.signal or 'a signal on another rank'} after step {run.step}; "
                       f"checkpoint-{run.step} is saved; continue with --resume_from_checkpoint latest")
                break
    bar.close()
    if last_saved != run.step:  # the final checkpoint: collective, every rank calls it
        save(run)


class StopRequest:
    """SIGTERM (schedulers, torchrun forwarding a kill) or SIGINT (Ctrl-C) ask the loop to stop: the current step
    finishes, the ranks agree (a rank that got no signal follows the others), a checkpoint is written and the run
    exits 0. A second signal interrupts at once; the last complete checkpoint is then what a resume starts from."""

    def __init__(self):
        self.signal: str | None = None
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
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        print(f"[post_train] {self.signal}: finishing this step, then a checkpoint (send it again to stop at once)",
              file=sys.stderr, flush=True)

    def agreed(self, device) -> bool:
        """Whether any rank was asked to stop (collective: every rank calls it once per step)."""
        from sage_grpo.parallel.dist import all_reduce_sum

        flag = all_reduce_sum(torch.tensor([float(self.signal is not None)], device=device))
        return float(flag[0]) > 0


def log(run: Run, step: int, metrics: dict) -> None:
    if run.logger is not None:
        run.logger.log(step, metrics)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    run_cli(main)
