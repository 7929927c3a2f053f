"""Dual trust region (paper Eq. 11-15, 40-42; docs/algorithm.md "The rest of the algorithm").

Two references constrain the policy:
- position: the anchor pi_ref_N, a frozen copy refreshed every N optimizer updates (never refreshed = fixed KL to
  pi_0). KL_pos is the closed-form KL of the two Gaussian steps taken from the same x_t, which share the variance
  V_t of the active sampler: mean over elements of (mean_theta - mean_ref)^2 / (2 (V_t + 1e-6)).
- velocity: the previous policy pi_{k-1} that produced the rollout; KL_vel is the k1 estimate on its samples,
  mean(logp_old - logp_new).
The total L_KL = beta_pos * KL_pos + beta_vel * KL_vel is scaled by the adaptive coefficient lambda_KL.
"""

from __future__ import annotations

import math
from collections import deque

import torch
from torch import Tensor

__all__ = [
    "KL_VAR_EPS",
    "uses_position_kl",
    "kl_position",
    "kl_velocity",
    "dual_kl",
    "AdaptiveKLController",
    "ADAPT_DIRECTIONS",
    "KL_VARIANTS",
    "KL_REDUCTIONS",
    "POSITION_VARIANTS",
    "VELOCITY_VARIANTS",
    "MOVING_ANCHOR_VARIANTS",
    "kl_variant",
    "kl_term_weights",
]

KL_VAR_EPS = 1e-6  # keeps KL_pos finite on deterministic steps (V_t = 0)
ADAPT_DIRECTIONS = ("paper", "classic")


def kl_position(mean_theta: Tensor, mean_ref: Tensor, variance: Tensor) -> Tensor:
    """Closed-form KL(N(mean_theta, V) || N(mean_ref, V)) per sample -> [B] (mean over non-batch elements).

    mean_theta, mean_ref: [B, ...]; variance: V_t as [B] or a scalar (the same for both Gaussians).
    """
    diff = mean_theta.float() - mean_ref.float()  # [B, ...]
    var = torch.as_tensor(variance, dtype=torch.float32, device=diff.device)
    if var.ndim == 1:
        var = var.reshape(-1, *([1] * (diff.ndim - 1)))  # [B, 1, ...]
    return (diff**2 / (2.0 * (var + KL_VAR_EPS))).reshape(diff.shape[0], -1).mean(dim=1)


def kl_velocity(logp_old: Tensor, logp_new: Tensor) -> Tensor:
    """k1 estimate of KL(pi_{k-1} || pi_theta) on rollout samples, per sample -> logp_old - logp_new."""
    return logp_old.detach() - logp_new


KL_REDUCTIONS = ("mean", "sum")


def dual_kl(
    kl_pos: Tensor | None,
    kl_vel: Tensor | None,
    *,
    beta_pos: float = 1.0,
    beta_vel: float = 0.1,
    reduction: str = "mean",
) -> Tensor:
    """L_KL = beta_pos * KL_pos + beta_vel * KL_vel, each term reduced over its pairs: "mean" (the paper's
    expectation) or "sum" (what `sage_grpo.grpo.grpo_backward` accumulates: its loss is a sum over the valid pairs,
    divided by the update's pair count afterwards). A missing term (None) counts as 0."""
    if kl_pos is None and kl_vel is None:
        raise ValueError("dual_kl needs at least one of kl_pos, kl_vel")
    if reduction not in KL_REDUCTIONS:
        raise ValueError(f"reduction must be one of {KL_REDUCTIONS}, got {reduction!r}")
    total = None
    for beta, kl in ((beta_pos, kl_pos), (beta_vel, kl_vel)):
        if kl is None:
            continue
        # an empty term (every reward of the micro-batch failed) counts 0, not mean([]) = NaN
        term = beta * (kl.mean() if reduction == "mean" and kl.numel() else kl.sum())
        total = term if total is None else total + term
    return total


KL_VARIANTS = ("none", "fixed", "moving", "stepwise", "dual", "dual_fixed")
POSITION_VARIANTS = ("fixed", "moving", "dual", "dual_fixed")  # have KL_pos: need an anchor model
VELOCITY_VARIANTS = ("stepwise", "dual", "dual_fixed")  # have KL_vel
MOVING_ANCHOR_VARIANTS = ("moving", "dual")  # refresh the anchor from the policy


def kl_variant(kl_cfg) -> str:
    """Name of the KL variant the authors' flags select (`kl_cfg`: a `sage_grpo.config.KLConfig`).

    none: kl_weight 0. fixed: anchor = initial model, position term only. moving: anchor refreshed every
    update_ref_model_step updates, position term only. stepwise: use_dual_kl with dual_kl_moving_weight 0 (velocity
    term only). dual: moving anchor + step-wise term (the paper's default). dual_fixed: fixed anchor + step-wise term.
    """
    if kl_cfg.kl_weight <= 0:
        return "none"
    if kl_cfg.use_dual_kl:
        if kl_cfg.dual_kl_moving_weight == 0:
            return "stepwise"
        return "dual" if kl_cfg.use_moving_KL else "dual_fixed"
    return "moving" if kl_cfg.use_moving_KL else "fixed"


def uses_position_kl(kl_cfg) -> bool:
    """Whether the selected variant has the position term KL_pos, i.e. needs an anchor model."""
    return kl_variant(kl_cfg) in POSITION_VARIANTS


def kl_term_weights(kl_cfg) -> tuple[float, float]:
    """(beta_pos, beta_vel) of L_KL for the selected variant: the dual weights with use_dual_kl, else (1, 0)."""
    variant = kl_variant(kl_cfg)
    if variant == "none":
        return 0.0, 0.0
    if kl_cfg.use_dual_kl:
        return float(kl_cfg.dual_kl_moving_weight), float(kl_cfg.dual_kl_step_weight)
    return 1.0, 0.0


class AdaptiveKLController:
    """The adaptive lambda_KL of paper App. A.6, counted in optimizer updates.

    Warm-up for the first `warmup_updates` updates: lambda(k) = init + (lambda_max - init) * k / K (the paper's
    Eq. 41 with init = lambda_min, the authors' default kl_coef = kl_min_coef = 1e-7). Afterwards, with D the mean
    of the last `history` observed KL values: D > 1.5 target -> lambda *= 0.9 and D < 0.5 target -> lambda *= 1.1
    (direction "paper": a KL far above target relaxes the constraint, as the paper states), or the opposite
    (direction "classic": a large KL tightens it, as in PPO's adaptive KL), clipped to [lambda_min, lambda_max].

    Call `update(kl)` once per optimizer update with a KL value that is identical on every rank (all-reduce it
    first), so that the coefficient stays in lockstep; `state_dict` / `load_state_dict` carry it across resumes.
    """

    def __init__(
        self,
        *,
        init: float = 1e-7,
        lambda_min: float = 1e-7,
        lambda_max: float = 1e-5,
        target: float = 1e-5,
        warmup_updates: int = 100,
        history: int = 10,
        direction: str = "paper",
    ) -> None:
        if direction not in ADAPT_DIRECTIONS:
            raise ValueError(f"direction must be one of {ADAPT_DIRECTIONS}, got {direction!r}")
        if not 0.0 <= lambda_min <= lambda_max:
            raise ValueError(f"need 0 <= lambda_min <= lambda_max, got {lambda_min}, {lambda_max}")
        if history < 1 or warmup_updates < 0:
            raise ValueError("history must be >= 1 and warmup_updates >= 0")
        self.init, self.lambda_min, self.lambda_max = init, lambda_min, lambda_max
        self.target, self.warmup_updates, self.history, self.direction = target, warmup_updates, history, direction
        self.num_updates = 0
        self.value = self._warmup_value(0)
        self._kl_history: deque[float] = deque(maxlen=history)

    @classmethod
    def from_config(cls, kl_cfg) -> AdaptiveKLController:
        """The authors' flag mapping (`kl_cfg`: a `sage_grpo.config.KLConfig`): kl_weight is lambda_max and, unless
        kl_target is set, the target; kl_coef starts the warm-up; kl_min_coef is lambda_min. kl_weight 0 (KL off)
        gives a controller whose value is always 0."""
        if kl_cfg.kl_weight <= 0:
            return cls(init=0.0, lambda_min=0.0, lambda_max=0.0, target=0.0, warmup_updates=0,
                       history=kl_cfg.kl_history, direction=kl_cfg.kl_adapt_direction)
        return cls(
            init=kl_cfg.kl_coef,
            lambda_min=kl_cfg.kl_min_coef,
            lambda_max=kl_cfg.kl_weight,
            target=kl_cfg.kl_weight if kl_cfg.kl_target is None else kl_cfg.kl_target,
            warmup_updates=kl_cfg.kl_warmup_updates,
            history=kl_cfg.kl_history,
            direction=kl_cfg.kl_adapt_direction,
        )

    def _warmup_value(self, k: int) -> float:
        if self.warmup_updates == 0:  # no warm-up: start where kl_coef says, within the bounds
            return min(max(self.init, self.lambda_min), self.lambda_max)
        return self.init + (self.lambda_max - self.init) * min(k, self.warmup_updates) / self.warmup_updates

    @property
    def kl_mean(self) -> float:
        """Mean of the recorded KL history (nan when empty)."""
        return sum(self._kl_history) / len(self._kl_history) if self._kl_history else float("nan")

    def update(self, observed_kl: float) -> float:
        """Record the KL of the update just taken and move to the coefficient of the next update.

        A non-finite KL is not recorded (it would freeze the history mean for H updates); the update still counts.
        """
        if math.isfinite(float(observed_kl)):
            self._kl_history.append(float(observed_kl))
        self.num_updates += 1
        if self.num_updates <= self.warmup_updates:
            self.value = self._warmup_value(self.num_updates)
            return self.value
        d = self.kl_mean
        up, down = (1.1, 0.9) if self.direction == "paper" else (0.9, 1.1)
        if d > 1.5 * self.target:
            self.value *= down
        elif d < 0.5 * self.target:
            self.value *= up
        self.value = min(max(self.value, self.lambda_min), self.lambda_max)
        return self.value

    def state_dict(self) -> dict:
        """Everything needed to continue exactly (plain Python types: safe to store as JSON)."""
        return {"value": self.value, "num_updates": self.num_updates, "kl_history": list(self._kl_history)}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output."""
        self.value = float(state["value"])
        self.num_updates = int(state["num_updates"])
        self._kl_history = deque((float(x) for x in state["kl_history"]), maxlen=self.history)
