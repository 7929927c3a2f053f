"""One SDE step for GRPO rollouts and re-scoring: the five samplers of docs/algorithm.md "The samplers".

dance_grpo, flow_grpo and sage_grpo are the same Euler-Maruyama step of the marginal-preserving reverse SDE and
differ only in the variance V_t of the noise injected over the step:

    mean_t  = x + v * dt - V_t / (2 * sigma_t) * x1_hat,   x1_hat = x + (1 - sigma_t) * v,   dt = sigma_{t+1} - sigma_t
    x_{t+1} = mean_t + sqrt(V_t) * xi

cps (Wang and Yu, 2025) is a different family that recombines the predicted data and noise:

    mean_t  = (1 - sigma_{t+1}) * x0_hat + sqrt(sigma_{t+1}^2 - s_t^2) * x1_hat,   s_t = sigma_{t+1} * sin(eta * pi / 2)

and ode is the deterministic Euler step x + v * dt (eta = 0 of every SDE reduces to it).

Everything is a pure tensor function: no scheduler object, no globals, fp32 math whatever the input dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import SageGRPOError

__all__ = [
    "SAGE_SIGMA_CLAMP",
    "SAMPLERS",
    "CPS_LOGPROB_MODES",
    "SDEStepOutput",
    "check_sampler",
    "check_sage_schedule",
    "step_variance",
    "mean_sensitivity",
    "sde_step",
    "gaussian_log_prob",
]

# sage_grpo clamps sigma_t to at most 1 - 3e-3 inside the log so that step 0 (sigma = 1) stays finite
# (paper App. A.3 regime (c)). Overridable per call through `sage_clamp`.
SAGE_SIGMA_CLAMP = 1.0 - 3e-3

SAMPLERS = ("ode", "dance_grpo", "flow_grpo", "sage_grpo", "cps")
# "peer": -(x' - mean)^2 averaged, as every CPS implementation does; "normalized": the full Gaussian log-density.
CPS_LOGPROB_MODES = ("peer", "normalized")
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def check_sampler(sde_type: str) -> str:
    """Return `sde_type` if it names a sampler, else fail listing the valid names."""
    if sde_type not in SAMPLERS:
        raise ValueError(f"unknown sde_type {sde_type!r}; valid samplers: {', '.join(SAMPLERS)}")
    return sde_type


@dataclass
class SDEStepOutput:
    """Result of one step. B = batch size."""

    prev_sample: Tensor  # [B, ...] x_{t+1}, in the dtype of the input sample (the storage dtype)
    log_prob: Tensor  # [B] fp32: mean over non-batch elements
    mean: Tensor  # [B, ...] fp32 mean of x_{t+1} given x_t
    std: Tensor  # [B] fp32 sqrt(V_t), one value per sample


def _as_batch_tensor(value: float | Tensor, batch: int, device: torch.device) -> Tensor:
    """A float or per-sample sigma -> fp32 [B]."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    if t.ndim == 0:
        return t.expand(batch).clone()
    t = t.reshape(-1)
    if t.numel() != batch:
        raise ValueError(f"per-sample sigma has {t.numel()} entries for a batch of {batch}")
    return t


def _bcast(v: Tensor, ndim: int) -> Tensor:
    """[B] -> [B, 1, ..., 1] with `ndim` dims in all, so it broadcasts over 4-D or 5-D latents."""
    return v.reshape(v.shape[0], *([1] * (ndim - 1)))


def _sage_integral(sigma: Tensor, sigma_next: Tensor, sage_clamp: float) -> Tensor:
    """log((1 - sigma_next) / (1 - min(sigma, clamp))) - (sigma - sigma_next), in fp64 whatever the input dtype and
    written with log1p: near sigma = 0 the two terms cancel to ~ sigma * delta, which the plain fp32 form rounds to
    <= 0 on long low-shift schedules (e.g. 155 steps with shift 0.05)."""
    s, sn = sigma.double(), sigma_next.double()
    s_bar = s.clamp(max=sage_clamp)
    return torch.log1p((s_bar - sn) / (1.0 - s_bar)) - (s - sn)


def _sage_schedule_integrals(num_steps: int, shift: float, sage_clamp: float) -> list[tuple[Tensor, Tensor]]:
    """[(sigmas, integral per step)] for the schedule in fp32 (as `sde_step` receives it) and in fp64 (as the
    equalizer receives it): both must pass."""
    from .schedule import sigma_schedule

    sig64 = sigma_schedule(num_steps, shift)
    return [(sig, _sage_integral(sig[:-1], sig[1:], sage_clamp)) for sig in (sig64.float(), sig64)]


def _sage_schedule_ok(num_steps: int, shift: float, sage_clamp: float) -> bool:
    """Whether every sage_grpo step of the schedule has V_t > 0."""
    return all(bool((v > 0).all()) for _, v in _sage_schedule_integrals(num_steps, shift, sage_clamp))


def _largest(ok, lo: float, hi: float, integer: bool) -> float | None:
    """Bisection for the largest x in [lo, hi) with ok(x), assuming ok holds below some threshold; None if ok(lo)
    fails."""
    if not ok(lo):
        return None
    for _ in range(60):
        if (integer and hi - lo <= 1) or (not integer and hi - lo <= 1e-4 * hi):
            break
        mid = (lo + hi) // 2 if integer else (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _refuse_silent_sage_steps(
    sigma: Tensor,
    sigma_next: Tensor,
    integral: Tensor,
    sage_clamp: float,
    num_steps: int | None = None,
    shift: float | None = None,
) -> None:
    """The one message for a sage_grpo step with V_t <= 0 (it would silently inject no noise, its log-prob would
    be 0 and it would train nothing). Names the first such step and, when the schedule is known, the nearest valid
    steps, shift and clamp."""
    bad = (integral <= 0).reshape(-1)
    if not bool(bad.any()):
        return
    i = int(bad.nonzero()[0])
    s, sn = float(sigma.reshape(-1)[i]), float(sigma_next.reshape(-1)[i])
    where = f"step {i} " if num_steps is not None else ""
    schedule = f"{num_steps} steps, shift {shift:g} and " if num_steps is not None and shift is not None else ""
    msg = (
        f"sage_grpo {where}(sigma {s:.6f} -> {sn:.6f}) would inject no noise: V_t / eta^2 = log((1 - sigma_next) / "
        f"(1 - min(sigma, clamp))) - (sigma - sigma_next) = {float(integral.reshape(-1)[i]):.3g} <= 0 with "
        f"{schedule}--sage_sigma_clamp {sage_clamp}"
    )
    if num_steps is None or shift is None:
        raise SageGRPOError(msg + "; use fewer steps, a smaller shift or a --sage_sigma_clamp closer to 1")
    fixes = []
    steps = _largest(lambda t: _sage_schedule_ok(int(t), shift, sage_clamp), 1, num_steps, integer=True)
    if steps:
        fixes.append(f"fewer steps (at most {int(steps)} with shift {shift:g})")
    sh = _largest(lambda x: _sage_schedule_ok(num_steps, x, sage_clamp), shift * 1e-6, shift, integer=False)
    if sh:
        k = 3 - math.floor(math.log10(sh))  # 4 significant digits, rounded down so that the value works
        sh = math.floor(sh * 10**k) / 10**k
        fixes.append(f"a smaller shift (at most {sh:g} with {num_steps} steps)")
    # the smallest clamp that works (a clamp closer to 1 always helps), rounded up to 6 decimals
    d = _largest(lambda d: _sage_schedule_ok(num_steps, shift, 1.0 - d), 1e-12, 1.0 - sage_clamp, integer=False)
    hint = math.floor((1.0 - d) * 1e6 + 1) / 1e6 if d else 1.0
    ok = hint < 1.0 and _sage_schedule_ok(num_steps, shift, hint)
    fixes.append("a --sage_sigma_clamp closer to 1" + (f" (at least {hint:.6f})" if ok else ""))
    use = fixes[0] if len(fixes) == 1 else ", ".join(fixes[:-1]) + " or " + fixes[-1]
    raise SageGRPOError(f"{msg}; use {use}")


def check_sage_schedule(num_steps: int, shift: float, sage_clamp: float = SAGE_SIGMA_CLAMP) -> None:
    """Refuse (SageGRPOError) a sage_grpo schedule on which some step has V_t <= 0: where sigma_t is clamped, the
    variance integral is negative once sigma_1 exceeds about clamp - 9e-6 (default clamp: from 68 steps on with
    shift 5, 84 with shift 4, 167 with shift 2, 333 with shift 1); such a step would silently inject no noise.
    V_t is evaluated as `step_variance` evaluates it, on the fp32 and the fp64 schedule. The one check behind the
    config, generate.py, plot_sde.py and `sde_step` itself."""
    for sig, integral in _sage_schedule_integrals(num_steps, shift, sage_clamp):
        _refuse_silent_sage_steps(sig[:-1], sig[1:], integral, sage_clamp, num_steps, shift)


def step_variance(
    sde_type: str,
    sigma: Tensor,
    sigma_next: Tensor,
    eta: float,
    *,
    sigma_max: float | Tensor | None = None,
    sage_clamp: float = SAGE_SIGMA_CLAMP,
) -> Tensor:
    """Variance V_t of the noise injected over the step sigma -> sigma_next (same shape as sigma, fp32 or fp64).

    dance_grpo: eta^2 * delta
    flow_grpo:  eta^2 * sigma / (1 - sigma') * delta, sigma' = sigma_max where sigma == 1 (FlowGRPO's rule)
    sage_grpo:  eta^2 * [log((1 - sigma_next) / (1 - min(sigma, clamp))) - delta]   (paper Eq. 5, exact integral)
    cps:        (sigma_next * sin(eta * pi / 2))^2
    ode:        0

    sage_grpo with eta > 0 refuses (SageGRPOError, the message of `check_sage_schedule`) a step whose V_t <= 0:
    such a step would silently inject no noise.
    """
    check_sampler(sde_type)
    sigma = torch.as_tensor(sigma)
    sigma_next = torch.as_tensor(sigma_next, dtype=sigma.dtype, device=sigma.device)
    delta = sigma - sigma_next
    if sde_type == "ode":
        return torch.zeros_like(sigma)
    if sde_type == "dance_grpo":
        return eta**2 * delta
    if sde_type == "flow_grpo":
        at_one = sigma >= 1.0
        if bool(at_one.any()):
            if sigma_max is None:
                raise ValueError(
                    "flow_grpo at sigma = 1 needs sigma_max (the schedule's second value, sigmas[1])"
                )
            sigma_max = torch.as_tensor(sigma_max, dtype=sigma.dtype, device=sigma.device)
        denom_sigma = torch.where(at_one, sigma_max, sigma) if bool(at_one.any()) else sigma
        return eta**2 * sigma / (1.0 - denom_sigma) * delta
    if sde_type == "sage_grpo":
        integral = _sage_integral(sigma, sigma_next, sage_clamp)
        if eta > 0:
            _refuse_silent_sage_steps(sigma, sigma_next, integral, sage_clamp)
        return (eta**2 * integral).to(sigma.dtype if sigma.is_floating_point() else torch.get_default_dtype())
    # cps
    s = sigma_next * math.sin(eta * math.pi / 2.0)
    return s * s


def mean_sensitivity(sde_type: str, sigma: Tensor, sigma_next: Tensor, variance: Tensor) -> Tensor:
    """d mean_t / d v, the sensitivity of the step mean to the network output (paper App. A.5; the equalizer row of
    docs/algorithm.md "The rest of the algorithm")."""
    check_sampler(sde_type)
    dt = sigma_next - sigma
    if sde_type == "cps":
        s_sq = variance
        return -sigma * (1.0 - sigma_next) + (1.0 - sigma) * torch.sqrt((sigma_next**2 - s_sq).clamp(min=0.0))
    safe_sigma = torch.where(sigma > 0, sigma, torch.ones_like(sigma))
    return dt - variance / 2.0 * (1.0 - sigma) / safe_sigma


def gaussian_log_prob(x: Tensor, mean: Tensor, variance: Tensor) -> Tensor:
    """Elementwise log N(x; mean, variance) in fp32; 0 where variance == 0 (a deterministic step carries no
    policy gradient). `variance` broadcasts against x."""
    var = variance.float()
    pos = var > 0
    safe_var = torch.where(pos, var, torch.ones_like(var))
    lp = -((x.float() - mean.float()) ** 2) / (2.0 * safe_var) - 0.5 * torch.log(safe_var) - _LOG_SQRT_2PI
    return torch.where(pos, lp, torch.zeros_like(lp))


def _draw_noise(shape: torch.Size, device: torch.device, generator) -> Tensor:
    """Standard normal noise [B, ...] in fp32; `generator` is None, one generator, or one per sample."""
    if isinstance(generator, Sequence) and not isinstance(generator, torch.Generator):
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}")
        return torch.stack(
            [torch.randn(shape[1:], generator=g, device=device, dtype=torch.float32) for g in generator]
        )
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32)


def sde_step(
    sde_type: str,
    model_output: Tensor,
    sample: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    eta: float,
    *,
    sigma_max: float | Tensor | None = None,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    noise: Tensor | None = None,
    cps_logprob: str = "peer",
    sage_clamp: float = SAGE_SIGMA_CLAMP,
) -> SDEStepOutput:
    """One sampler step from x_t = `sample` with velocity `model_output`.

    Rollout: leave `prev_sample` None; x_{t+1} is drawn with `noise` or from `generator` (one, or one per sample),
    then cast to sample.dtype (the storage dtype) *before* its log-prob is taken, so that re-scoring the stored
    sample reproduces the rollout log-prob exactly. Re-scoring: pass the stored `prev_sample`.

    sigma / sigma_next: Python floats or per-sample tensors [B]. Latents: [B, C, H, W] or [B, C, F, H, W].
    sigma_max: the schedule's second value, used by flow_grpo where sigma = 1.
    The log-prob is the mean over the non-batch elements, as every peer's (under sequence parallelism every rank
    holds the full velocity, so there is no sharded reduction).
    cps_logprob: "peer" (-(x' - mean)^2, what every CPS implementation uses) or "normalized" (Gaussian density).
    """
    check_sampler(sde_type)
    if cps_logprob not in CPS_LOGPROB_MODES:
        raise ValueError(f"cps_logprob must be one of {CPS_LOGPROB_MODES}, got {cps_logprob!r}")
    if sample.ndim < 2:
        raise ValueError(f"sample must have a batch dim and at least one more, got shape {tuple(sample.shape)}")
    batch, ndim, device = sample.shape[0], sample.ndim, sample.device
    x = sample.float()  # [B, ...]
    v = model_output.float()  # [B, ...]
    s = _as_batch_tensor(sigma, batch, device)  # [B]
    s_next = _as_batch_tensor(sigma_next, batch, device)  # [B]
    var = step_variance(sde_type, s, s_next, eta, sigma_max=sigma_max, sage_clamp=sage_clamp).float()  # [B]
    var = var.clamp(min=0.0)
    sb, snb, vb = _bcast(s, ndim), _bcast(s_next, ndim), _bcast(var, ndim)  # [B, 1, ...]

    if sde_type == "cps":
        x0_hat = x - sb * v  # predicted data
        x1_hat = x + (1.0 - sb) * v  # predicted noise
        mean = (1.0 - snb) * x0_hat + torch.sqrt((snb**2 - vb).clamp(min=0.0)) * x1_hat
    else:
        mean = x + v * (snb - sb)
        if sde_type != "ode":
            safe_sb = torch.where(sb > 0, sb, torch.ones_like(sb))
            mean = mean - vb / (2.0 * safe_sb) * (x + (1.0 - sb) * v)  # + (V/2) * score

    std = var.sqrt()  # [B]
    if prev_sample is None:
        if noise is None:
            noise = _draw_noise(sample.shape, device, generator)
        prev_sample = (mean + _bcast(std, ndim) * noise.float()).to(sample.dtype)  # storage round trip
    x_next = prev_sample.float()

    if sde_type == "cps" and cps_logprob == "peer":
        elementwise = -((x_next - mean) ** 2)
    else:
        elementwise = gaussian_log_prob(x_next, mean, vb)
    log_prob = elementwise.reshape(batch, -1).sum(dim=1) / elementwise[0].numel()  # [B]
    return SDEStepOutput(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std)
