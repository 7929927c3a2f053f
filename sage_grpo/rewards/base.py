"""Reward protocol, registry, failure-tolerant scoring and the weighted composite.

A reward scores decoded videos ``float [B, F, C, H, W]`` in ``[0, 1]`` (on the reward's device) against their
prompts and returns named per-video scores ``{name: tensor [B]}``. A score that could not be computed is NaN, never
0: the advantage code masks NaN rewards out of the group statistics, while a 0 would be a real (and usually very
good or very bad) reward (defect 9 of the authors' code).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
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


# Optional attribute of a reward (not part of the protocol's check): ``runs_on_cpu = True`` says that its work is
# on the CPU (detectors over CPU tensors, a network client) and never on the accelerator, so the trainer may score it
# in a worker thread on CPU frames while the rollout keeps the accelerator (post_train.py's overlap). Default False.


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


def is_import_path(name: str) -> bool:
    """True for ``package.module:factory`` and ``path/to/file.py:factory`` (registered names have no colon)."""
    return ":" in name


def reward_key(name: str) -> str:
    """The key a reward is known by: registered names are case-insensitive, import paths are not (file systems and
    Python attributes are case-sensitive)."""
    return name.strip() if is_import_path(name) else name.strip().lower()


def get_reward_builder(name: str) -> Callable[..., Reward]:
    """The builder registered as ``name``, or for an import path the user's factory wrapped so that whatever goes
    wrong in it is one SageGRPOError line; a SageGRPOError listing the valid names otherwise."""
    if is_import_path(name):
        return _plugin_builder(name.strip())
    key = name.strip().lower()
    if key not in _REGISTRY:
        close = difflib.get_close_matches(key, reward_names(), n=1)
        raise SageGRPOError(
            f"unknown reward {name!r}; {f'did you mean {close[0]}? ' if close else ''}valid names for --reward_model "
            f"are: {', '.join(reward_names())} "
            "(several may be combined with commas, e.g. 'videoalign_local,clipscore'), or an import path "
            "'package.module:factory' / 'path/to/file.py:factory'"
        )
    return _REGISTRY[key]


# ----------------------------------------------------------------------------------------------------------------
# Rewards by import path: package.module:factory or path/to/file.py:factory
# ----------------------------------------------------------------------------------------------------------------

_PLUGIN_MODULES: dict[str, ModuleType] = {}  # resolved file path or module name -> module (imported once)


def _load_plugin_module(where: str, spec: str) -> ModuleType:
    """Import the file (relative to the working directory) or module of an import path, once per process."""
    is_file = where.endswith(".py") or "/" in where or os.sep in where
    if is_file:
        path = Path(where).expanduser().resolve()
        key = str(path)
        if key in _PLUGIN_MODULES:
            return _PLUGIN_MODULES[key]
        if not path.is_file():
            raise SageGRPOError(f"--reward_model {spec}: file {where} not found (relative to the working directory "
                                f"{Path.cwd()})")
        # a unique module name per file, registered in sys.modules so that dataclasses in the user's file can look
        # their module up
        stem = re.sub(r"\W", "_", path.stem)
        name = f"sage_grpo_reward_plugin_{stem}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"
        mspec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(mspec)
        sys.modules[name] = module
        try:
            mspec.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - the user's file: any error is theirs, one line
            del sys.modules[name]
            raise SageGRPOError(f"--reward_model {spec}: importing {where} failed ({type(err).__name__}: "
                                f"{_one_line(err)})") from None
    else:
        key = where
        if key in _PLUGIN_MODULES:
            return _PLUGIN_MODULES[key]
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as err:
            missing = err.name or where
            if where == missing or where.startswith(missing + "."):
                raise SageGRPOError(f"--reward_model {spec}: module {where!r} not found (is it installed or on "
                                    "PYTHONPATH? a file is written path/to/file.py:factory)") from None
            raise SageGRPOError(f"--reward_model {spec}: importing {where} failed (it needs module {missing!r}, "
                                "which is not installed)") from None
        except Exception as err:  # noqa: BLE001
            raise SageGRPOError(f"--reward_model {spec}: importing {where} failed ({type(err).__name__}: "
                                f"{_one_line(err)})") from None
    _PLUGIN_MODULES[key] = module
    return module


def _one_line(err: BaseException) -> str:
    """An exception's message on one line (user errors are one line)."""
    return " ".join(str(err).split()) or "no message"


def check_reward(reward: object, spec: str) -> None:
    """Raise a SageGRPOError unless ``reward`` has the `Reward` protocol: non-empty string `components`, a
    `default_weights` mapping over them and a `__call__`."""
    if not isinstance(reward, Reward):
        missing = [a for a in ("components", "default_weights", "__call__") if not hasattr(reward, a)]
        raise SageGRPOError(f"--reward_model {spec}: the factory returned {type(reward).__name__}, not a Reward "
                            f"(missing {', '.join(missing)}; see docs/rewards.md)")
    comps = reward.components
    if isinstance(comps, str) or not isinstance(comps, Sequence) or not comps or \
            not all(isinstance(c, str) and c for c in comps):
        raise SageGRPOError(f"--reward_model {spec}: components must be a non-empty tuple of names, got {comps!r}")
    dw = reward.default_weights
    if not isinstance(dw, Mapping) or any(k not in comps for k in dw):
        raise SageGRPOError(f"--reward_model {spec}: default_weights must map some of its components "
                            f"({', '.join(comps)}) to numbers, got {dw!r}")


def _plugin_builder(spec: str) -> Callable[..., Reward]:
    """Resolve ``spec`` (module or file imported now, so a typo fails before any model loads) -> a builder that
    calls the user's factory with the built-in builders' keyword arguments and checks what it returns."""
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise SageGRPOError(f"--reward_model {spec}: an import path is 'package.module:factory' or "
                            "'path/to/file.py:factory'")
    module = _load_plugin_module(where, spec)
    factory = getattr(module, attr, None)
    if factory is None:
        public = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise SageGRPOError(f"--reward_model {spec}: {where} has no attribute {attr!r} (callables there: "
                            f"{', '.join(public) or 'none'})")
    if not callable(factory):
        raise SageGRPOError(f"--reward_model {spec}: {where}:{attr} is a {type(factory).__name__}, not a factory "
                            "function or class")

    def build(**kwargs: object) -> Reward:
        try:
            reward = factory(**kwargs)
        except Exception as err:  # noqa: BLE001 - the user's factory: one line, not their traceback
            raise SageGRPOError(f"--reward_model {spec}: the factory raised {type(err).__name__}: "
                                f"{_one_line(err)}") from None
        check_reward(reward, spec)
        return reward

    build.__name__ = f"plugin:{spec}"
    return build


def check_first_call(reward: Reward, spec: str, videos: torch.Tensor, prompts: Sequence[str]) -> None:
    """Call a freshly built reward once on ``videos`` [B, F, 3, H, W] (B >= 2) and raise one SageGRPOError line when
    it raises, misses a component or returns anything but a tensor [B] per component: training would otherwise
    turn every such step into NaN, silently."""
    n = videos.shape[0]
    try:
        out = reward(videos, list(prompts))
    except Exception as err:  # noqa: BLE001
        raise SageGRPOError(f"--reward_model {spec}: a first call on {n} test videos {tuple(videos.shape)} raised "
                            f"{type(err).__name__}: {_one_line(err)}") from None
    if not isinstance(out, Mapping):
        raise SageGRPOError(f"--reward_model {spec}: a call must return {{component: tensor [B]}}, got "
                            f"{type(out).__name__}")
    for c in reward.components:
        if c not in out:
            raise SageGRPOError(f"--reward_model {spec}: a first call returned no {c!r} (got {sorted(out)}; "
                                f"components: {', '.join(reward.components)})")
        v = out[c]
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != (n,):
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise SageGRPOError(f"--reward_model {spec}: component {c!r} of a first call on {n} videos is {got}, "
                                f"expected a tensor of shape ({n},)")


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
    any weighted component makes that video's total NaN. ``optional`` names the components whose failure does not
    mask a video in training: the trainer then combines the components itself
    (`sage_grpo.advantage.combine_components`); ``total`` stays the plain weighted sum that is logged and validated.
    """

    def __init__(self, rewards: Mapping[str, Reward], weights: Mapping[str, float] | None = None,
                 optional: Sequence[str] = ()):
        """Combine named rewards; ``weights`` None means each reward's ``default_weights``; ``optional``: component
        names (case-insensitive)."""
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
        by_lower = {c.lower(): c for c in self.components}
        unknown = [o for o in optional if o.strip().lower() not in by_lower]
        if unknown:
            raise SageGRPOError(f"--reward_optional names an unknown component {unknown[0]!r}; the selected reward(s) "
                                f"provide: {', '.join(self.components)}")
        self.optional = frozenset(by_lower[o.strip().lower()] for o in optional)

    @property
    def runs_on_cpu(self) -> bool:
        """Whether every reward of the composite says its work is on the CPU (``runs_on_cpu``), so that the whole
        composite can score CPU frames in a worker thread without touching the accelerator."""
        return all(getattr(r, "runs_on_cpu", False) is True for r in self.rewards.values())

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
