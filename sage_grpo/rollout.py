"""The GRPO rollout over the HunyuanVideo-1.5 policy, and the re-scoring the update calls.

One rollout: N = prompts x G latents start from per-sample noise x_0 at sigma = 1 and take T steps of `sde_step`
(docs/algorithm.md) down the shifted schedule. Each step runs the transformer once on 2N inputs when CFG is
on ([cond..., uncond...], v = v_u + s * (v_c - v_u), the diffusers guider's formula) and keeps x_{t+1} in the
storage dtype with its log-prob. `policy_step` recomputes the step for stored samples through the *same* function
(`predict_velocity`: same CFG layout, input dtype and autocast), so re-scoring the stored x_{t+1} with unchanged
weights gives the rollout log-prob back exactly (ratio 1).

Randomness: every sample owns a generator per use, seeded from (base seed, prompt seed, generation index, step)
by a hash, so a rollout is reproducible, independent of batch composition, and identical on every rank of a
sequence-parallel group without RNG lockstep. `use_same_noise` gives the G samples of a prompt one initial noise
(the SDE noise still differs, otherwise the group would be G copies).

Image-to-video: `image` (sage_grpo.models.image_cond.ImageConditioning, one reference image's conditioning per
sample) fills the condition channels (image latent in frame 0, mask 1 there) and `image_embeds`, in both CFG
branches; the trajectory keeps it, so re-scoring, the anchor and the update see each sample's own image. Without it
(text-to-video) those inputs are zeros, as in diffusers' T2V pipeline.

SDE windows (sage_grpo.window): `sde_steps` [T] marks the steps that run the SDE; the others are deterministic
Euler (ODE) steps whose log-prob is stored as NaN (they are never trained). With `share_prefix` and one initial noise
per group, the leading ODE steps are identical for the G samples of a prompt and run once per prompt.

Time runs the pipeline's way here: x_0 is noise and x_T the clean sample (the paper's x_1 ... x_0 reversed).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from tqdm.auto import tqdm

from sage_grpo.models.image_cond import ImageConditioning, condition_channels
from sage_grpo.models.text_cache import TextConditioning
from sage_grpo.schedule import sigma_schedule
from sage_grpo.sde import SAGE_SIGMA_CLAMP, SDEStepOutput, check_sampler, sde_step
from sage_grpo.seeding import derive_seed
from sage_grpo.window import ODE_SOLVERS, prefix_steps, tail_sigmas, tail_start

__all__ = [
    "SamplerSettings",
    "Trajectory",
    "derive_seed",
    "initial_noise",
    "predict_velocity",
    "rollout",
    "policy_step",
    "decode_latents",
    "latent_shape",
]

INIT_NOISE_STEP = -1  # the "step" of the initial noise in derive_seed


@dataclass(frozen=True)
class SamplerSettings:
    """Everything that decides a step's numbers; the rollout stores it and the update reuses it."""

    sde_type: str = "sage_grpo"
    eta: float = 0.5
    num_steps: int = 20  # T
    shift: float = 5.0
    cfg_scale: float = 6.0  # 1 = no CFG (a single forward of N)
    cps_logprob: str = "peer"
    sage_clamp: float = SAGE_SIGMA_CLAMP
    ode_solver: str = "euler"  # the ODE after the SDE window (the tail): euler or unipc
    ode_steps: int = 0  # solver steps of the tail; 0 = one per schedule step
    compute_dtype: torch.dtype | None = None  # transformer inputs; None = the transformer's parameter dtype
    autocast: bool = False  # wrap the forward in torch.autocast(compute_dtype) (fp32 master weights)
    master_dtype: torch.dtype | None = None  # dtype of the trained weights; under autocast the timestep stays in
    # it (None = the first parameter's dtype, which is the frozen base's with LoRA: pass it explicitly there)

    def __post_init__(self):
        check_sampler(self.sde_type)
        if self.ode_solver not in ODE_SOLVERS:
            raise ValueError(f"unknown ode_solver {self.ode_solver!r}; use one of {', '.join(ODE_SOLVERS)}")

    @property
    def use_cfg(self) -> bool:
        return self.cfg_scale != 1.0

    @classmethod
    def from_config(cls, cfg) -> SamplerSettings:
        """From sage_grpo.config.Config (rollout + model groups); training forwards autocast to model.dtype."""
        from sage_grpo.config import torch_dtype

        r, m = cfg.rollout, cfg.model
        return cls(
            sde_type=r.sde_type,
            eta=r.eta,
            num_steps=r.grpo_sampling_steps,
            shift=r.flow_shift,
            cfg_scale=r.cfg_scale,
            cps_logprob=r.cps_logprob,
            sage_clamp=r.sage_sigma_clamp,
            ode_solver=r.ode_solver,
            ode_steps=r.ode_steps,
            compute_dtype=torch_dtype(m.dtype),
            autocast=torch_dtype(m.dtype) != torch_dtype(m.master_weight_type),
            master_dtype=torch_dtype(m.master_weight_type),
        )


@dataclass
class Trajectory:
    """A rollout of B = prompts x G samples over T steps. Latent shape [C, F, H, W] = (channels, latent frames,
    latent height, latent width)."""

    latents: Tensor  # [B, T+1, C, F, H, W] storage dtype; [:, 0] noise at sigma = 1, [:, T] the sample
    log_probs: Tensor  # [B, T] fp32 log pi(x_{t+1} | x_t) of the rollout policy
    sigmas: Tensor  # [T+1] fp64 schedule, 1 -> 0
    step_indices: Tensor  # [T] long: diffusion index of each stored transition (0..T-1)
    prompt_ids: Tensor  # [B] long: index into the caller's prompt list (the group id)
    generation_ids: Tensor  # [B] long: index within the group, 0..G-1
    prompt_seeds: Tensor  # [B] long: per-prompt seeds that, with generation_ids, seeded the noise
    prompts: list[str]  # [B]
    cond: TextConditioning  # [B, ...] prompt conditioning (device, compute dtype)
    uncond: TextConditioning | None  # [B, ...] negative-prompt conditioning; None without CFG
    settings: SamplerSettings = field(default_factory=SamplerSettings)
    image: ImageConditioning | None = None  # [B, ...] each sample's reference image (I2V); None for T2V
    sde_steps: Tensor | None = None  # [T] bool: the steps that ran the SDE (the window); None = every step

    @property
    def batch_size(self) -> int:
        return self.latents.shape[0]

    @property
    def num_steps(self) -> int:
        return self.latents.shape[1] - 1

    @property
    def final_latents(self) -> Tensor:
        return self.latents[:, -1]  # [B, C, F, H, W]


def _generators(seeds: list[int], device: torch.device) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(s) for s in seeds]


def latent_shape(vae_config, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
    """[C, F, H, W] of the latent of a num_frames x height x width video (as the pipeline's prepare_latents)."""
    t, s = vae_config.temporal_compression_ratio, vae_config.spatial_compression_ratio
    if (num_frames - 1) % t or height % s or width % s:
        raise ValueError(f"video {num_frames}x{height}x{width} must be (k*{t}+1) frames and multiples of {s} pixels")
    return vae_config.latent_channels, (num_frames - 1) // t + 1, height // s, width // s


def initial_noise(
    shape: tuple[int, ...], base_seed: int, prompt_seeds: Tensor, generation_ids: Tensor, *, same_noise: bool,
    device: torch.device, dtype: torch.dtype,
) -> tuple[Tensor, list[int]]:
    """x_0 [B, *shape] in `dtype` (drawn fp32) and the per-sample seeds used; same_noise ignores the generation."""
    seeds = [
        derive_seed(base_seed, int(ps), 0 if same_noise else int(g), INIT_NOISE_STEP)
        for ps, g in zip(prompt_seeds.tolist(), generation_ids.tolist())
    ]
    noise = torch.stack([torch.randn(shape, generator=g, device=device, dtype=torch.float32)
                         for g in _generators(seeds, device)])
    return noise.to(dtype), seeds


def predict_velocity(
    transformer, latents: Tensor, sigma: Tensor, cond: TextConditioning, uncond: TextConditioning | None,
    settings: SamplerSettings, image_tokens: int, image: ImageConditioning | None = None,
    sigma_next: Tensor | None = None,
) -> Tensor:
    """Guided velocity v [B, C, F, H, W] (fp32) at per-sample sigma [B]. The one place that calls the transformer,
    used by the rollout and by the update, so both run the same layout, dtype and autocast.

    latents: [B, C, F, H, W] any dtype (cast to the compute dtype, as the pipeline feeds transformer.dtype).
    cond / uncond: [B, ...]; uncond is used iff settings.use_cfg. image_tokens: the pipeline's
    vision_num_semantic_tokens (the zero image embeds of t2v). image: [B, ...] reference-image conditioning (i2v);
    the same in the negative branch, which changes only the text. sigma_next: [B] the step's target sigma, for a
    step-distilled (use_meanflow) transformer, which takes timestep_r = 1000 sigma_next (0 at the last step), as
    diffusers' I2V pipeline passes the next timestep.
    """
    param_dtype = settings.master_dtype or next(transformer.parameters()).dtype
    dtype = settings.compute_dtype or param_dtype
    b = latents.shape[0]
    x = latents.to(dtype)
    cond_latent, mask = condition_channels(image, x)  # [B, C, F, H, W], [B, 1, F, H, W]: zeros for t2v
    model_in = torch.cat([x, cond_latent, mask], dim=1)  # [B, 2C+1, F, H, W]
    if image is None:
        image_embeds = torch.zeros(b, image_tokens, transformer.config.image_embed_dim, dtype=dtype, device=x.device)
    else:
        image_embeds = image.embeds.to(x.device, dtype)  # [B, T_img, D_img]
    c = cond
    if settings.use_cfg:
        if uncond is None:
            raise ValueError("cfg_scale != 1 needs the negative-prompt conditioning")
        model_in = torch.cat([model_in, model_in], dim=0)  # [2B, 2C+1, F, H, W]: cond first, then uncond
        image_embeds = torch.cat([image_embeds, image_embeds])  # [2B, T_img, D_img]: the image in both branches
        c = TextConditioning.cat([cond, uncond])
        sigma = torch.cat([sigma, sigma])
        sigma_next = torch.cat([sigma_next, sigma_next]) if sigma_next is not None else None
    c = c.to(x.device, dtype)
    # [B'] t = 1000 sigma in the input dtype, as the pipeline does; under autocast (fp32 master weights) it stays
    # fp32, since rounding 1000 sigma to bf16 would move t by up to 2.
    timestep = (sigma.to(x.device, torch.float64) * 1000.0).to(param_dtype if settings.autocast else dtype)
    timestep_r = None
    if transformer.config.use_meanflow:  # step-distilled: the r-timestep embedding is added to the time embedding
        if sigma_next is None:
            raise ValueError("a use_meanflow (step-distilled) transformer needs sigma_next for its timestep_r")
        timestep_r = (sigma_next.to(x.device, torch.float64) * 1000.0).to(timestep.dtype)  # [B']
    ctx = torch.autocast(x.device.type, dtype=dtype) if settings.autocast else contextlib.nullcontext()
    with ctx:
        out = transformer(
            hidden_states=model_in,
            timestep=timestep,
            timestep_r=timestep_r,
            encoder_hidden_states=c.prompt_embeds,
            encoder_attention_mask=c.prompt_mask,
            encoder_hidden_states_2=c.byt5_embeds,
            encoder_attention_mask_2=c.byt5_mask,
            image_embeds=image_embeds,
            return_dict=False,
        )[0].float()  # [B', C, F, H, W]
    if not settings.use_cfg:
        return out
    v_cond, v_uncond = out[:b], out[b:]
    return v_uncond + settings.cfg_scale * (v_cond - v_uncond)  # diffusers' ClassifierFreeGuidance


def _step(settings: SamplerSettings, v: Tensor, x: Tensor, sigmas: Tensor, steps: Tensor, **kw) -> SDEStepOutput:
    """sde_step at per-sample diffusion indices `steps` [B]."""
    if settings.sde_type == "ode" and "prev_sample" not in kw:
        kw = {"noise": torch.zeros((), device=x.device).expand(x.shape)}  # deterministic: draw nothing
    return sde_step(
        settings.sde_type, v, x, sigmas[steps], sigmas[steps + 1], settings.eta,
        sigma_max=float(sigmas[1]),
        cps_logprob=settings.cps_logprob, sage_clamp=settings.sage_clamp, **kw,
    )


def ode_tail(velocity: Callable[[Tensor, Tensor, Tensor], Tensor], x: Tensor, sigmas: Tensor, solver: str) -> Tensor:
    """The deterministic ODE through `sigmas` [n + 1] (ending at 0) from x [B, ...] at sigmas[0] -> the end point,
    in x's dtype. velocity(x, sigma, sigma_next) -> the guided velocity [B, ...] (fp32) at x and the scalar sigma of
    a step to sigma_next (a step-distilled transformer's timestep_r).

    euler: sde_step's ODE step x + (sigma_b - sigma_a) v, so on the schedule's sigmas it is the rollout's own ODE.
    unipc: diffusers' UniPCMultistepScheduler (flow prediction, x0 = x - sigma v, order 2, bh2, the last step first
    order) on exactly these sigmas (flow_shift 1 keeps them as given); its state lives in this call, so a chunk's
    tail is the same numbers as the whole batch's."""
    if float(sigmas[-1]) != 0.0:
        raise ValueError("the ODE tail must end at sigma 0")
    if solver == "euler":
        for a, b in zip(sigmas[:-1], sigmas[1:]):
            n = x.shape[0]
            x = sde_step("ode", velocity(x, a, b), x, a.expand(n), b.expand(n), 0.0,
                         noise=torch.zeros((), device=x.device).expand(x.shape)).prev_sample
        return x
    from diffusers import UniPCMultistepScheduler

    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=1.0,
                                    solver_order=2, final_sigmas_type="zero")
    sched.set_timesteps(sigmas=sigmas[:-1].cpu().numpy(), device=x.device)  # it appends the final 0
    sched.set_begin_index(0)  # its timesteps are int(1000 sigma): close sigmas could share one; count steps instead
    dtype, y = x.dtype, x.float()
    for k, (a, b) in enumerate(zip(sigmas[:-1], sigmas[1:])):
        y = sched.step(velocity(y.to(dtype), a, b), sched.timesteps[k], y, return_dict=False)[0].float()
    return y.to(dtype)


@torch.no_grad()
def rollout(
    transformer,
    cond: TextConditioning,
    uncond: TextConditioning | None,
    *,
    prompts: list[str],
    prompt_ids: Tensor,
    generation_ids: Tensor,
    prompt_seeds: Tensor,
    latent_shape: tuple[int, int, int, int],
    settings: SamplerSettings,
    image_tokens: int,
    base_seed: int = 0,
    same_noise: bool = False,
    storage_dtype: torch.dtype = torch.float32,
    show_progress: bool = False,
    initial_latents: Tensor | None = None,
    chunk_size: int = 0,
    device: torch.device | str | None = None,
    image: ImageConditioning | None = None,
    on_chunk: Callable[[Tensor, Tensor], None] | None = None,
    sde_steps: Tensor | None = None,
    share_prefix: bool = False,
    agree_calls: Callable[[int], int] | None = None,
) -> Trajectory:
    """Sample B trajectories (B = len(prompts); the caller repeats each prompt G times).

    cond: [B, ...]; uncond: [B, ...] or [1, ...] (broadcast), ignored without CFG. prompt_ids / generation_ids /
    prompt_seeds: [B] long. latent_shape: [C, F, H, W] (see `latent_shape`). storage_dtype: dtype of the stored
    latents (every x_{t+1} is rounded to it before its log-prob is taken). initial_latents: [B, C, F, H, W] to
    bypass the seeded noise (tests). show_progress: the caller passes rank == 0. chunk_size: samples per
    transformer call (0 = all B at once); the update re-scores in the same chunks, so that its first ratio is exactly
    1 (a matmul's rounding depends on the batch it runs in). device: where the latents live (default: the
    conditioning's device). image: [B, ...] each sample's reference-image conditioning (i2v; its latent size must be
    latent_shape's), None for t2v. on_chunk(indices [c], final latents [c, C, F, H, W]): run the chunks one after
    another, each through all steps, and hand each finished chunk over at once (post_train scores it while the
    next chunk samples); the samples are the same as in the default order (steps outermost), which the tests
    check bitwise. sde_steps: [T] bool, the SDE window (None = every step); the other steps are ODE steps with a
    NaN log-prob. share_prefix (needs same_noise): the ODE steps before the window run once per prompt (the first
    sample of each prompt id) and every sample of the prompt takes their result. agree_calls(n) -> the number of
    prefix transformer calls every rank makes (FSDP2 needs the same forwards on every rank; a rank with fewer
    prompts repeats its last call); default n.
    """
    device = torch.device(device) if device is not None else cond.prompt_embeds.device
    cond = cond.to(device)
    if image is not None:
        image = image.to(device)
    b, t_steps = len(prompts), settings.num_steps
    if settings.use_cfg and uncond is not None and len(uncond) == 1 and b > 1:
        uncond = uncond.index([0] * b)
    sigmas = sigma_schedule(t_steps, settings.shift).to(device)  # [T+1] fp64
    if initial_latents is None:
        x, _ = initial_noise(latent_shape, base_seed, prompt_seeds, generation_ids, same_noise=same_noise,
                             device=device, dtype=storage_dtype)
    else:
        x = initial_latents.to(device, storage_dtype)
    latents = torch.empty((b, t_steps + 1, *x.shape[1:]), dtype=storage_dtype, device=device)  # [B, T+1, C, F, H, W]
    log_probs = torch.empty((b, t_steps), dtype=torch.float32, device=device)  # [B, T]
    latents[:, 0] = x
    chunks = list(torch.arange(b, device=device).split(chunk_size or b))
    sde = torch.ones(t_steps, dtype=torch.bool) if sde_steps is None else torch.as_tensor(sde_steps).bool().cpu()
    if sde.shape != (t_steps,):
        raise ValueError(f"sde_steps must be [{t_steps}] bool, got shape {tuple(sde.shape)}")
    ode = replace(settings, sde_type="ode")

    def velocity(c: Tensor, x_c: Tensor, steps: Tensor) -> Tensor:
        """Guided velocity [n, C, F, H, W] of the samples `c` [n] at x_c, diffusion indices steps [n]."""
        return predict_velocity(transformer, x_c, sigmas[steps], cond.index(c),
                                uncond.index(c) if settings.use_cfg else None, settings, image_tokens,
                                image.index(c) if image is not None else None, sigmas[steps + 1])

    def take(c: Tensor, i: int, v: Tensor, x_c: Tensor) -> Tensor:
        """Step i of the samples `c` [n] from x_c with velocity v -> x_{i+1}, stored with its log-prob."""
        steps = torch.full((len(c),), i, dtype=torch.long, device=device)
        if sde[i]:
            seeds = [derive_seed(base_seed, int(ps), int(g), i)
                     for ps, g in zip(prompt_seeds[c.cpu()].tolist(), generation_ids[c.cpu()].tolist())]
            out = _step(settings, v, x_c, sigmas, steps, generator=_generators(seeds, device))
            log_probs[c, i] = out.log_prob
        else:  # outside the window: deterministic, nothing to train
            out = _step(ode, v, x_c, sigmas, steps)
            log_probs[c, i] = math.nan
        latents[c, i + 1] = out.prev_sample  # storage dtype
        return out.prev_sample

    first = 0
    if share_prefix and prefix_steps(sde) > 0:
        if not same_noise:
            raise ValueError("share_prefix needs same_noise: without it the samples of a group differ from x_0")
        first = prefix_steps(sde)
        # one representative (the first sample) per prompt id; `owner` [B] maps each sample to its representative
        ids = prompt_ids.tolist()
        reps = sorted({ids.index(p) for p in ids})
        owner = torch.tensor([reps.index(ids.index(p)) for p in ids], device=device)
        reps = torch.tensor(reps, device=device)
        rep_chunks = list(reps.split(chunk_size or len(reps)))
        calls = agree_calls(len(rep_chunks)) if agree_calls is not None else len(rep_chunks)
        rep_chunks += rep_chunks[-1:] * (calls - len(rep_chunks))  # repeated calls keep the ranks' forwards equal
        x_r = x[reps]  # [P, C, F, H, W]
        for i in tqdm(range(first), desc="rollout prefix", disable=not show_progress, leave=False):
            steps = torch.full((len(reps),), i, dtype=torch.long, device=device)
            v = torch.cat([velocity(c, x[c], steps[: len(c)]) for c in rep_chunks])[: len(reps)]  # [P, C, F, H, W]
            x_r = _step(ode, v, x_r, sigmas, steps).prev_sample
            x = x_r[owner]  # [B, C, F, H, W]
            latents[:, i + 1] = x
            log_probs[:, i] = math.nan
    # The ODE tail after the window: the schedule's own steps, or --ode_steps solver steps evenly spaced in sigma.
    # Only its end point is kept (at every tail index): no tail step is trained, their log-probs stay NaN.
    hi = tail_start(sde) if sde.any() else t_steps
    tail = tail_sigmas(sigmas, hi, settings.ode_steps)  # [n + 1]
    solve_tail = hi < t_steps and (settings.ode_solver != "euler" or tail.numel() - 1 < t_steps - hi)
    end = hi if solve_tail else t_steps

    def run_tail(c: Tensor, x_c: Tensor) -> Tensor:
        """The tail of the samples `c` [n] from x_c at index hi -> their end points [n, C, F, H, W]."""
        def v_at(y: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:  # the rollout's forwards, in its chunks
            parts = torch.arange(len(c), device=device).split(chunk_size or len(c))
            return torch.cat([predict_velocity(
                transformer, y[k], sigma.expand(len(k)), cond.index(c[k]),
                uncond.index(c[k]) if settings.use_cfg else None, settings, image_tokens,
                image.index(c[k]) if image is not None else None, sigma_next.expand(len(k))) for k in parts])

        out = ode_tail(v_at, x_c, tail, settings.ode_solver)
        latents[c, hi + 1:] = out.unsqueeze(1)  # [n, T - hi, ...]
        log_probs[c, hi:] = math.nan
        return out

    # the steps after the prefix: each sample on its own
    if on_chunk is None:
        for i in tqdm(range(first, end), desc="rollout", disable=not show_progress, leave=False):
            steps = torch.full((b,), i, dtype=torch.long, device=device)
            v = torch.cat([velocity(c, x[c], steps[c]) for c in chunks])  # [B, C, F, H, W]
            x = take(torch.arange(b, device=device), i, v, x)
        if solve_tail:
            x = run_tail(torch.arange(b, device=device), x)
    else:
        bar = tqdm(total=(end - first) * len(chunks), desc="rollout", disable=not show_progress, leave=False)
        for c in chunks:
            x_c = x[c]
            for i in range(first, end):
                steps = torch.full((len(c),), i, dtype=torch.long, device=device)
                x_c = take(c, i, velocity(c, x_c, steps), x_c)
                bar.update()
            if solve_tail:
                x_c = run_tail(c, x_c)
            on_chunk(c, x_c)
        bar.close()
    return Trajectory(
        latents=latents,
        log_probs=log_probs,
        sigmas=sigmas,
        step_indices=torch.arange(t_steps, device=device),
        prompt_ids=prompt_ids.to(device),
        generation_ids=generation_ids.to(device),
        prompt_seeds=prompt_seeds.to(device),
        prompts=list(prompts),
        cond=cond,
        uncond=uncond if settings.use_cfg else None,
        settings=settings,
        image=image,
        sde_steps=None if sde_steps is None else sde.to(device),
    )


def policy_step(
    transformer, traj: Trajectory, indices: Tensor | list[int], steps: Tensor | int, image_tokens: int
) -> SDEStepOutput:
    """Re-score stored transitions x_t -> x_{t+1} of samples `indices` [b] at diffusion steps `steps` (int or
    [b]) under `transformer` (the policy with grad, or the frozen anchor). Gradients flow when enabled by the
    caller. -> SDEStepOutput: log_prob [b] (compare with traj.log_probs[indices, steps]), mean [b, C, F, H, W]
    (fp32, for KL_pos), std [b], prev_sample = the stored x_{t+1}."""
    idx = torch.as_tensor(indices, dtype=torch.long, device=traj.latents.device)
    st = torch.as_tensor(steps, dtype=torch.long, device=idx.device).expand(idx.shape[0]).contiguous()
    x_t = traj.latents[idx, st]  # [b, C, F, H, W] storage dtype
    x_next = traj.latents[idx, st + 1]  # [b, C, F, H, W]
    cond = traj.cond.index(idx)
    uncond = traj.uncond.index(idx) if traj.uncond is not None else None
    image = traj.image.index(idx) if traj.image is not None else None
    v = predict_velocity(transformer, x_t, traj.sigmas[st], cond, uncond, traj.settings, image_tokens, image,
                         traj.sigmas[st + 1])
    return _step(traj.settings, v, x_t, traj.sigmas, st, prev_sample=x_next)


@torch.no_grad()
def decode_latents(vae, latents: Tensor, *, chunk: int = 1) -> Tensor:
    """Latents [B, C, F, H, W] -> frames [B, F', 3, H', W'] fp32 in [0, 1].

    Divides by the VAE scaling factor exactly once (the authors divide twice), and decodes `chunk` samples at a
    time: diffusers 0.42.1's VAE fails on batches > 1 in its mid-block attention. Enable vae tiling for real sizes.
    """
    frames = []
    for start in range(0, latents.shape[0], chunk):
        z = latents[start : start + chunk].to(vae.dtype) / vae.config.scaling_factor
        video = vae.decode(z, return_dict=False)[0]  # [b, 3, F', H', W'] in [-1, 1]
        frames.append((video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4))  # [b, F', 3, H', W']
    return torch.cat(frames)
