"""Reward protocol, registry, failure-tolerant scoring and the weighted composite.

A reward scores decoded videos ``float [B, F, C, H, W]`` in ``[0, 1]`` (on the reward's device) against their
prompts and returns named per-video scores ``{name: tensor [B]}``. A score that could not be computed is NaN, never
0: the advantage code masks NaN rewards out of the group statistics, while a 0 would be a real (and usually very
good or very bad) reward (defect 9 of the authors' code).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from sage_grpo.errors import SageGRPOError


@runtime_checkable
class Reward(Protocol):
    """What every reward implements."""

    #: component names this reward returns, in a fixed order
    components: tuple[str, ...]
    #: weights used when the user gives none, e.g. {"VQ": 0.5, "MQ": 0.5, "TA": 1.0}
    default_weights: dict[str, float]

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score ``videos`` float [B, F, C, H, W] in [0, 1] against ``prompts`` (len B); returns name -> [B]."""
        ...


# ----------------------------------------------------------------------------------------------------------------
# Registry: name -> builder(**kwargs) -> Reward
# ----------------------------------------------------------------------------------------------------------------

_REGISTRY: dict[str, Callable[..., Reward]] = {}


def register_reward(name: str) -> Callable[[Callable[..., Reward]], Callable[..., Reward]]:
    """Decorator registering a reward builder under ``name`` (lower case)."""

    def deco(builder: Callable[..., Reward]) -> Callable[..., Reward]:
        key = name.lower()
        if key in _REGISTRY:
            raise ValueError(f"reward {name!r} registered twice")
        _REGISTRY[key] = builder
        return builder

    return deco


def reward_names() -> list[str]:
    """Sorted names of all registered rewards."""
    return sorted(_REGISTRY)


def get_reward_builder(name: str) -> Callable[..., Reward]:
    """The builder registered as ``name``; a SageGRPOError listing the valid names otherwise."""
    key = name.strip().lower()
    if key not in _REGISTRY:
        raise SageGRPOError(
            f"unknown reward {name!r}; valid names for --reward_model are: {', '.join(reward_names())} "
            "(several may be combined with commas, e.g. 'videoalign_local,clipscore')"
        )
    return _REGISTRY[key]


# ----------------------------------------------------------------------------------------------------------------
# Failure-tolerant scoring
# ----------------------------------------------------------------------------------------------------------------


def _nan_scores(components: Sequence[str], n: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A dict of all-NaN float32 score vectors [n]."""
    return {c: torch.full((n,), float("nan"), dtype=torch.float32, device=device) for c in components}


def _check_output(out: Mapping[str, torch.Tensor], components: Sequence[str], n: int) -> None:
    """Raise if a reward returned missing components or wrongly shaped scores."""
    for c in components:
        if c not in out:
            raise RuntimeError(f"reward returned no {c!r} (got {sorted(out)})")
        if tuple(out[c].shape) != (n,):
            raise RuntimeError(f"reward component {c!r} has shape {tuple(out[c].shape)}, expected ({n},)")


def score_safely(reward: Reward, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
    """Score a batch; if the batched call raises, score video by video and give NaN to the ones that fail.

    Returns float32 tensors [B] on the device of ``videos``. Non-finite scores are turned into NaN so that
    downstream masking has one sentinel to look for.
    """
    n = videos.shape[0]
    if len(prompts) != n:
        raise ValueError(f"{n} videos but {len(prompts)} prompts")
    comps = tuple(reward.components)
    try:
        out = reward(videos, prompts)
        _check_output(out, comps, n)
        result = {c: out[c].detach().float().to(videos.device) for c in comps}
    except Exception as batch_err:  # noqa: BLE001 - a reward model must never take the whole step down
        warnings.warn(
            f"{type(reward).__name__} failed on a batch of {n} ({type(batch_err).__name__}: {batch_err}); "
            "scoring the videos one at a time",
            RuntimeWarning,
            stacklevel=2,
        )
        result = _nan_scores(comps, n, videos.device)
        for i in range(n):
            try:
                one = reward(videos[i : i + 1], [prompts[i]])
                _check_output(one, comps, 1)
                for c in comps:
                    result[c][i] = one[c].detach().float().to(videos.device)[0]
            except Exception as err:  # noqa: BLE001
                warnings.warn(
                    f"{type(reward).__name__} failed on video {i} ({type(err).__name__}: {err}); its score is NaN",
                    RuntimeWarning,
                    stacklevel=2,
                )
    # inf would poison group means as surely as NaN but is harder to spot: use one sentinel
    return {c: torch.where(torch.isfinite(v), v, torch.full_like(v, float("nan"))) for c, v in result.items()}


# ----------------------------------------------------------------------------------------------------------------
# Weights and the composite
# ----------------------------------------------------------------------------------------------------------------


def parse_reward_weights(spec: str | Mapping[str, float] | None, valid: Sequence[str]) -> dict[str, float] | None:
    """Parse ``--reward_weights`` (JSON object or mapping) into {canonical component name: weight}.

    Keys are matched case-insensitively against ``valid`` component names. ``None`` or an empty string means
    "use the rewards' default weights" and returns None.
    """
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return None
    if isinstance(spec, str):
        try:
            raw = json.loads(spec)
        except json.JSONDecodeError as err:
            raise SageGRPOError(
                f"--reward_weights is not valid JSON ({err.msg} at char {err.pos}): {spec!r}; "
                'write it like \'{"VQ":0.5,"MQ":0.5,"TA":1.0}\' (double quotes, no trailing comma)'
            ) from None
    else:
        raw = dict(spec)
    if not isinstance(raw, dict) or not raw:
        raise SageGRPOError(
            f"--reward_weights must be a non-empty JSON object mapping component names to numbers, got {spec!r}"
        )
    by_lower = {v.lower(): v for v in valid}
    weights: dict[str, float] = {}
    for key, w in raw.items():
        name = by_lower.get(str(key).strip().lower())
        if name is None:
            raise SageGRPOError(
                f"--reward_weights names an unknown component {key!r}; the selected reward(s) provide: "
                f"{', '.join(valid)}"
            )
        if name in weights:
            raise SageGRPOError(f"--reward_weights gives {name!r} twice (keys are case-insensitive)")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(float(w)):
            raise SageGRPOError(f"--reward_weights[{key!r}] must be a finite number, got {w!r}")
        weights[name] = float(w)
    return weights


class CompositeReward:
    """Several rewards combined as ``total = sum_k w_k * component_k``; returns the total and every component.

    Components with weight 0 are logged but do not enter the total (so a NaN there cannot make it NaN). A NaN in
    any weighted component makes that video's total NaN, which the advantage code masks.
    """

    def __init__(self, rewards: Mapping[str, Reward], weights: Mapping[str, float] | None = None):
        """Combine named rewards; ``weights`` None means each reward's ``default_weights``."""
        if not rewards:
            raise SageGRPOError("no reward selected: set --reward_model")
        self.rewards = dict(rewards)
        comps: list[str] = []
        for name, r in self.rewards.items():
            for c in r.components:
                if c == "total":
                    raise SageGRPOError(f"reward {name!r} names a component 'total', which is reserved for the "
                                        "weighted "
                                        "sum of the components; rename that component")
                if c in comps:
                    raise SageGRPOError(f"reward {name!r} provides component {c!r} which another reward provides too")
                comps.append(c)
        self.components = tuple(comps)
        if weights is None:
            weights = {}
            for r in self.rewards.values():
                weights.update(r.default_weights)
        self.weights = {c: float(w) for c, w in weights.items()}
        unknown = [c for c in self.weights if c not in self.components]
        if unknown:
            raise SageGRPOError(f"weights name unknown components {unknown}; valid: {', '.join(self.components)}")
        if not any(w != 0 for w in self.weights.values()):
            raise SageGRPOError("all reward weights are 0: the total reward would carry no signal")

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score ``videos`` [B, F, C, H, W]; returns {"total": [B], component: [B], ...} (float32)."""
        out: dict[str, torch.Tensor] = {}
        for r in self.rewards.values():
            out.update(score_safely(r, videos, prompts))
        total = torch.zeros(videos.shape[0], dtype=torch.float32, device=videos.device)
        for c, w in self.weights.items():
            if w != 0:
                total = total + w * out[c]  # [B]; NaN propagates on purpose
        return {"total": total, **out}
