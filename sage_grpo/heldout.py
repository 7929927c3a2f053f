"""Held-out validation metrics: what validation reports beside the trained reward, on the videos it already made.

`--validation_metrics` names groups and rewards (default `auto`):

* ``components``: the trained reward's components that `--reward_weights` does not weight (e.g. VideoAlign's VQ and
  MQ when only TA is trained); computed by the reward call validation makes anyway;
* ``statistics``: `video_statistics` (mean luma, HSV chroma, spatial luma contrast, frame-to-frame change), less
  any that a reward component of the same name already reports;
* ``world``: `sage_grpo.world.metrics.heldout_metrics` (shape fidelity, background cleanliness, flicker off the
  objects, object persistence, caption attribute agreement per kind); needs every validation prompt to be a world
  caption. The caption kinds the trained world reward names (its `caption_kinds`) are left out, and the overall
  agreement with them;
* ``drift``: RMSE of each validation video from the same prompt's video at the run's first validation (the base
  model's, with `--validate_at_step0`), both reduced by `drift_frames`, which the first validation writes to
  output_dir/validation_reference/ (a resumed run reads them back);
* ``reference``: image-to-video only: `first_frame_fidelity`, 1 - RMSE of the video's first frame from its
  reference image (bucket-cropped to the video's size, both in [0, 1]): the trained reward never sees the image, so
  a run can drift away from it while the reward rises; with `statistics`' motion (frames that stop moving) it is
  what the hacking check watches for I2V;
* a registered reward name (``clipscore``, ``pickscore``, ``videoalign_local``, ...) or an import path
  (``package.module:factory``, ``path/to/file.py:factory``): built once for validation
  only (it loads its model on every rank) and its components reported;
* ``auto``: components, statistics, drift, reference when the validation prompts have reference images, and world
  when they are world captions; ``none``: nothing.

Each metric has a `sense` for `sage_grpo.hacking` (+1 higher is better, 0 no better side, None never checked).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sage_grpo.errors import SageGRPOError

__all__ = ["GROUPS", "STATISTICS", "WORLD_METRICS", "MetricsSpec", "parse_validation_metrics", "video_statistics",
           "drift_frames", "first_frame_fidelity", "HeldOut"]

GROUPS = ("auto", "none", "components", "statistics", "world", "drift", "reference")
STATISTICS = ("brightness", "saturation", "contrast", "motion")
WORLD_METRICS = ("shape_fidelity", "background_cleanliness", "temporal_consistency", "object_persistence",
                 "caption_agreement", "caption_background", "caption_color", "caption_shape", "caption_size",
                 "caption_motion")
_LUMA = (0.299, 0.587, 0.114)  # BT.601, as the brightness reward
DRIFT_FRAMES = 16  # drift_frames keeps at most this many frames ...
DRIFT_HEIGHT = 128  # ... at most this many pixels high


@dataclass(frozen=True)
class MetricsSpec:
    """`--validation_metrics` resolved: which groups, which validation-only rewards."""

    groups: frozenset = field(default_factory=frozenset)
    rewards: tuple[str, ...] = ()


def _world_prompts(prompts: Sequence[str]) -> str | None:
    """None when every prompt is a world caption; else the first error."""
    from sage_grpo.world.captions import parse_caption

    for p in prompts:
        try:
            parse_caption(p)
        except SageGRPOError as err:
            return str(err)
    return None if prompts else "no validation prompt"


def parse_validation_metrics(items: Sequence[str], trained: Sequence[str], prompts: Sequence[str],
                             has_images: bool = False) -> MetricsSpec:
    """`--validation_metrics` -> MetricsSpec; one SageGRPOError line for an unknown name, `none` with others, a
    trained reward named again, `world` with prompts that are not world captions, or `reference` without reference
    images. `trained`: the `--reward_model` names; `prompts`: the validation prompts; has_images: they have
    reference images (image-to-video)."""
    from sage_grpo.rewards import get_reward_builder, is_import_path, reward_key, reward_names

    names = [reward_key(str(i)) for i in items if str(i).strip()]
    known = reward_names()
    for n in names:
        if is_import_path(n):
            get_reward_builder(n)  # imported now: a missing file or attribute is one line before any model loads
        elif n not in GROUPS and n not in known:
            raise SageGRPOError(f"--validation_metrics: unknown {n!r}; use groups ({', '.join(GROUPS)}), reward "
                                f"names ({', '.join(known)}) or an import path (package.module:factory, "
                                "path/to/file.py:factory)")
    if "none" in names and len(names) > 1:
        raise SageGRPOError("--validation_metrics none reports no held-out metric: pass it alone")
    trained = {reward_key(t) for t in trained if t.strip()}
    again = [n for n in names if n in trained]
    if again:
        raise SageGRPOError(f"--validation_metrics {again[0]}: that reward is trained (--reward_model); its "
                            "components that --reward_weights does not weight are the group `components`")
    groups = {n for n in names if n in GROUPS}
    world_error = _world_prompts(prompts)
    if "world" in groups and world_error is not None:
        raise SageGRPOError(f"--validation_metrics world needs world captions as validation prompts: {world_error}")
    if "reference" in groups and not has_images:
        raise SageGRPOError("--validation_metrics reference compares each video's first frame with its reference "
                            "image: the validation prompts have none (text-to-video)")
    if "auto" in groups:
        groups |= {"components", "statistics", "drift"} | ({"world"} if world_error is None else set())
        groups |= {"reference"} if has_images else set()
    groups -= {"auto", "none"}
    rewards = tuple(dict.fromkeys(n for n in names if n not in GROUPS))
    return MetricsSpec(frozenset(groups), rewards)


def _check_videos(videos: torch.Tensor) -> None:
    if videos.ndim != 5 or videos.shape[2] != 3 or not videos.is_floating_point():
        raise ValueError(f"expected float videos [B, F, 3, H, W] in [0, 1], got {tuple(videos.shape)} {videos.dtype}")


def video_statistics(videos: torch.Tensor) -> dict[str, torch.Tensor]:
    """Pixel statistics of float videos [B, F, 3, H, W] in [0, 1] -> {name: float32 [B]}, each in [0, 1]:
    brightness (mean BT.601 luma), saturation (mean max - min over RGB: HSV chroma), contrast (standard deviation
    of the luma over each frame, mean over frames), motion (mean |x_{t+1} - x_t|; 0 for one frame)."""
    _check_videos(videos)
    x = videos.detach().float().clamp(0, 1)
    w = torch.tensor(_LUMA, device=x.device).view(1, 1, 3, 1, 1)
    luma = (x * w).sum(dim=2)  # [B, F, H, W]
    rgb_max, rgb_min = x.max(dim=2).values, x.min(dim=2).values
    motion = ((x[:, 1:] - x[:, :-1]).abs().mean(dim=(1, 2, 3, 4)) if x.shape[1] > 1
              else torch.zeros(x.shape[0], device=x.device))
    return {
        "brightness": luma.mean(dim=(1, 2, 3)),
        "saturation": (rgb_max - rgb_min).mean(dim=(1, 2, 3)),
        "contrast": luma.flatten(2).std(dim=2, unbiased=False).mean(dim=1),
        "motion": motion,
    }


def first_frame_fidelity(frames: torch.Tensor, image: torch.Tensor) -> float:
    """1 - RMSE between a video's first frame and its reference image: frames [F, 3, H, W], image [3, H, W] (the
    reference bucket-cropped to the video's size), both in [0, 1] -> a float in [0, 1] (1 = the same picture)."""
    if image.shape != frames.shape[1:]:
        raise ValueError(f"reference image {tuple(image.shape)} does not fit the frames {tuple(frames.shape)}")
    d = frames[0].detach().float().cpu().clamp(0, 1) - image.detach().float().cpu().clamp(0, 1)  # [3, H, W]
    return float(1.0 - d.pow(2).mean().sqrt())


def drift_frames(frames: torch.Tensor) -> torch.Tensor:
    """A validation video [F, 3, H, W] reduced for the drift metric: at most DRIFT_FRAMES evenly spaced frames,
    area-downscaled to at most DRIFT_HEIGHT pixels high -> float32 [f, 3, h, w] on CPU (~2 MB at 480x864)."""
    x = frames.detach().float().cpu().clamp(0, 1)
    pick = torch.linspace(0, x.shape[0] - 1, min(x.shape[0], DRIFT_FRAMES)).round().long()
    x = x[pick]
    h, w = x.shape[-2:]
    if h > DRIFT_HEIGHT:
        x = F.interpolate(x, size=(DRIFT_HEIGHT, max(1, round(w * DRIFT_HEIGHT / h))), mode="area")
    return x.contiguous()


class HeldOut:
    """The held-out metrics of a run: their names and senses (`senses`, in a fixed order every rank shares) and
    `score`, which computes them for one validation video. Built once by post_train's `setup`."""

    def __init__(self, spec: MetricsSpec, reward, extra: dict | None = None):
        """reward: the trained `CompositeReward`; extra: {name: Reward} built for validation only."""
        from sage_grpo.world.metrics import ATTRIBUTE_KINDS

        self.spec = spec
        self.extra = dict(extra or {})
        weights = reward.weights
        self.components = tuple(k for k in reward.components if weights.get(k, 0.0) == 0.0) \
            if "components" in spec.groups else ()
        senses: dict[str, int | None] = dict.fromkeys(self.components, 1)
        for name, r in self.extra.items():
            for k in r.components:
                if k in reward.components or k in senses:
                    raise SageGRPOError(f"--validation_metrics {name}: its component {k!r} is already reported "
                                        "(a trained reward or another validation metric has it)")
                senses[k] = 1
        taken = set(reward.components) | set(senses)
        self.statistics = tuple(s for s in STATISTICS if s not in taken) if "statistics" in spec.groups else ()
        senses.update(dict.fromkeys(self.statistics, 0))
        self.world: tuple[str, ...] = ()
        if "world" in spec.groups:
            named = {k for r in reward.rewards.values() for k in getattr(r, "caption_kinds", ())}
            skip = {f"caption_{k}" for k in named} | ({"caption_agreement"} if named else set())
            assert named <= set(ATTRIBUTE_KINDS), named
            self.world = tuple(m for m in WORLD_METRICS if m not in skip)
            senses.update({f"world_{m}": 1 for m in self.world})
        self.drift = "drift" in spec.groups
        if self.drift:
            senses["drift"] = None
        self.reference = "reference" in spec.groups
        if self.reference:
            senses["first_frame_fidelity"] = 1
        self.senses = senses
        self._failed: set[str] = set()

    @property
    def names(self) -> list[str]:
        return list(self.senses)

    def _guard(self, what: str, fn, names: Sequence[str]) -> dict[str, float]:
        """fn() -> {name: float}; NaN for `names` (and one warning per kind) when it raises: a metric must never
        take a run down."""
        try:
            return fn()
        except Exception as err:  # noqa: BLE001
            if what not in self._failed:
                self._failed.add(what)
                warnings.warn(f"validation metric {what} failed ({type(err).__name__}: {err}); reported as NaN",
                              RuntimeWarning, stacklevel=3)
            return dict.fromkeys(names, math.nan)

    def score(self, frames: torch.Tensor, prompt: str, scores: dict[str, float],
              reference: torch.Tensor | None, image: torch.Tensor | None = None) -> dict[str, float]:
        """One validation video [F, 3, H, W] in [0, 1]: its `scores` from the trained reward ({component: value}),
        its drift `reference` (`drift_frames` of the first validation's video; None = unknown), its reference
        `image` [3, H, W] in [0, 1] cropped to the video's size (I2V; None = unknown) -> {name: value}, one per
        name, NaN where a value is unknown."""
        from sage_grpo.rewards.base import score_safely
        from sage_grpo.world.metrics import heldout_metrics, reference_distance

        out = {k: float(scores[k]) for k in self.components}
        videos = frames[None]
        for r in self.extra.values():
            out.update({k: float(v[0]) for k, v in score_safely(r, videos, [prompt]).items()})
        if self.statistics:
            out.update(self._guard("statistics", lambda: {k: float(v[0]) for k, v in video_statistics(videos).items()
                                                           if k in self.statistics}, self.statistics))
        if self.world:
            def world():
                m = heldout_metrics(videos.float().cpu(), [prompt])
                return {f"world_{k}": float(m[k][0]) for k in self.world}

            out.update(self._guard("world", world, [f"world_{k}" for k in self.world]))
        if self.drift:
            small = drift_frames(frames)
            out["drift"] = (float(reference_distance(small[None], reference[None])[0])
                            if reference is not None and reference.shape == small.shape else math.nan)
        if self.reference and image is not None:
            out.update(self._guard("reference", lambda: {"first_frame_fidelity": first_frame_fidelity(frames, image)},
                                   ["first_frame_fidelity"]))
        return {k: out.get(k, math.nan) for k in self.senses}
