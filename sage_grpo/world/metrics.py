"""Held-out metrics of world videos: what a reward may trade away while it rises.

Each function scores a batch float [B, F, 3, H, W] in [0, 1] and returns float32 [B] (CPU), higher = better except
`reference_distance`. None of them is a training reward by default; validation reports them beside the trained
reward so that a rising reward with a falling metric reads as hacking, not learning:

* `caption_scores`: per attribute kind (background, colour, shape, size, motion), the share of the caption's
  attributes the detectors find; the kinds a reward does not name are the held-out ones;
* `shape_fidelity`: how well the best object matches a known shape (soft IoU with a fitted template; 0 = no object);
* `background_cleanliness`: how close the pixels off the objects are to the named background colour;
* `temporal_consistency`: 1 - mean frame-to-frame change of the pixels off the objects (flicker, not motion);
* `object_persistence`: smallest / largest per-frame area of the largest object (1 = a rigid object in every frame);
* `reference_distance`: RMSE from reference videos, e.g. the base model's samples for the same noise (drift).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from sage_grpo.world.captions import COLORS, Attributes, parse_caption
from sage_grpo.world.detectors import Detection, detect

__all__ = [
    "ATTRIBUTE_KINDS",
    "attribute_agreement",
    "caption_scores",
    "shape_fidelity",
    "background_cleanliness",
    "temporal_consistency",
    "object_persistence",
    "reference_distance",
    "heldout_metrics",
]

ATTRIBUTE_KINDS = ("background", "color", "shape", "size", "motion")
_OBJECT_KINDS = ATTRIBUTE_KINDS[1:]
_BG_SCALE = 0.5  # a pixel this far (RGB distance) from the named background colour scores 0 cleanliness


def _check_videos(videos: torch.Tensor) -> None:
    if videos.ndim != 5 or videos.shape[2] != 3 or not videos.is_floating_point():
        raise ValueError(f"expected float videos [B, F, 3, H, W] in [0, 1], got {tuple(videos.shape)} {videos.dtype}")


def attribute_agreement(det: Detection, attrs: Attributes) -> dict[str, float]:
    """Share of each attribute kind of ``attrs`` that ``det`` confirms, and ``"agreement"``, the share of all of
    them (1 background + 4 per object).

    Caption objects are matched to distinct detected objects by the assignment that confirms most attributes, so
    an object drawn in the wrong colour still earns its shape, size and motion.
    """
    caps, found = attrs.objects, det.objects

    def hits(assign: tuple[int | None, ...]) -> dict[str, int]:
        h = dict.fromkeys(_OBJECT_KINDS, 0)
        for cap, j in zip(caps, assign):
            if j is not None:  # None: this caption object was not found
                o = found[j]
                h["color"] += o.color == cap.color
                h["shape"] += o.shape == cap.shape
                h["size"] += o.size == cap.size
                h["motion"] += o.motion == attrs.motion
        return h

    slots = list(range(len(found))) + [None] * len(caps)
    # the first assignment with the most hits (deterministic: permutations come in a fixed order)
    best = max((hits(a) for a in itertools.permutations(slots, len(caps))), key=lambda h: sum(h.values()))
    bg = float(det.background == attrs.background)
    out = {"background": bg, **{k: best[k] / len(caps) for k in _OBJECT_KINDS}}
    out["agreement"] = (bg + sum(best.values())) / (1 + len(_OBJECT_KINDS) * len(caps))
    return out


def caption_scores(videos: torch.Tensor, prompts: Sequence[str],
                   detections: Sequence[Detection] | None = None) -> dict[str, torch.Tensor]:
    """`attribute_agreement` of each video with its prompt (a world caption; SageGRPOError otherwise):
    {"agreement", "background", "color", "shape", "size", "motion"} -> float32 [B]."""
    _check_videos(videos)
    if len(prompts) != videos.shape[0]:
        raise ValueError(f"{videos.shape[0]} videos but {len(prompts)} prompts")
    attrs = [parse_caption(p) for p in prompts]  # parse first: a bad prompt fails before any detection
    dets = detections if detections is not None else [detect(v) for v in videos]
    rows = [attribute_agreement(d, a) for d, a in zip(dets, attrs)]
    return {k: torch.tensor([r[k] for r in rows], dtype=torch.float32) for k in ("agreement", *ATTRIBUTE_KINDS)}


def _detections(videos: torch.Tensor, detections: Sequence[Detection] | None) -> Sequence[Detection]:
    _check_videos(videos)
    return detections if detections is not None else [detect(v) for v in videos]


def shape_fidelity(videos: torch.Tensor, detections: Sequence[Detection] | None = None) -> torch.Tensor:
    """Best shape IoU among each video's objects, weighted by the share of frames it is found in: [B] in [0, 1]."""
    dets = _detections(videos, detections)
    return torch.tensor([max((o.shape_iou * o.present for o in d.objects), default=0.0) for d in dets],
                        dtype=torch.float32)


def _off_object(det: Detection) -> torch.Tensor:
    """[F, H, W] bool: pixels at least one pixel away from anything an object tints (its faint edges included)."""
    grown = F.max_pool2d(det.support[:, None].float(), 3, stride=1, padding=1)[:, 0]  # [F, H, W]
    return grown == 0


def background_cleanliness(videos: torch.Tensor, detections: Sequence[Detection] | None = None) -> torch.Tensor:
    """``1 - mean(min(d / 0.5, 1))`` over the pixels off the objects, d = RGB distance to the named background
    colour: [B] in [0, 1], 1 = a plain background of a named colour."""
    dets = _detections(videos, detections)
    out = []
    for v, d in zip(videos.detach().float().cpu().clamp(0, 1), dets):
        bg = torch.tensor(COLORS[d.background]).view(1, 3, 1, 1)
        dist = (v - bg).norm(dim=1)  # [F, H, W]
        keep = _off_object(d)
        score = 1.0 - (dist[keep] / _BG_SCALE).clamp(max=1.0).mean() if keep.any() else torch.tensor(0.0)
        out.append(float(score))
    return torch.tensor(out, dtype=torch.float32)


def temporal_consistency(videos: torch.Tensor, detections: Sequence[Detection] | None = None) -> torch.Tensor:
    """``1 - mean |x_{t+1} - x_t|`` over channels and the pixels off the objects in both frames: [B] in [0, 1].

    Unlike the frame-difference demo reward it ignores the objects, so a moving object costs nothing and flicker
    or a drifting background does. A single-frame video scores 1.
    """
    dets = _detections(videos, detections)
    out = []
    for v, d in zip(videos.detach().float().cpu().clamp(0, 1), dets):
        if v.shape[0] < 2:
            out.append(1.0)
            continue
        off = _off_object(d)
        keep = off[1:] & off[:-1]  # [F-1, H, W]
        diff = (v[1:] - v[:-1]).abs().mean(dim=1)  # [F-1, H, W]
        out.append(float(1.0 - diff[keep].mean()) if keep.any() else 0.0)
    return torch.tensor(out, dtype=torch.float32)


def object_persistence(videos: torch.Tensor, detections: Sequence[Detection] | None = None) -> torch.Tensor:
    """Smallest over largest per-frame area of each video's largest object (0 when none is found): [B] in [0, 1]."""
    dets = _detections(videos, detections)
    out = []
    for d in dets:
        if not d.objects:
            out.append(0.0)
            continue
        area = d.objects[0].area  # [F]
        out.append(float(area.min() / area.max().clamp_min(1e-8)))
    return torch.tensor(out, dtype=torch.float32)


def reference_distance(videos: torch.Tensor, references: torch.Tensor, paired: bool = True) -> torch.Tensor:
    """RMSE of each video from ``references`` [R, F, 3, H, W]: from ``references[i]`` when ``paired`` (R == B, e.g.
    the base model's samples for the same noise), else from the nearest reference. [B], 0 = identical."""
    _check_videos(videos)
    _check_videos(references)
    if videos.shape[1:] != references.shape[1:]:
        raise ValueError(f"videos {tuple(videos.shape)} and references {tuple(references.shape)} differ in shape")
    a = videos.detach().float().cpu().flatten(1)  # [B, D]
    b = references.detach().float().cpu().flatten(1)  # [R, D]
    if paired:
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"paired distance needs as many references as videos, got {b.shape[0]} for {a.shape[0]}")
        return (a - b).square().mean(dim=1).sqrt()
    return (torch.cdist(a.double(), b.double()).square() / a.shape[1]).min(dim=1).values.sqrt().float()


def heldout_metrics(videos: torch.Tensor, prompts: Sequence[str] | None = None,
                    references: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Every metric above, detecting once: name -> float32 [B]. Caption kinds (``caption_<kind>``) need world
    ``prompts``; ``reference_distance`` needs paired ``references``."""
    dets = _detections(videos, None)
    out = {
        "shape_fidelity": shape_fidelity(videos, dets),
        "background_cleanliness": background_cleanliness(videos, dets),
        "temporal_consistency": temporal_consistency(videos, dets),
        "object_persistence": object_persistence(videos, dets),
    }
    if prompts is not None:
        out.update({f"caption_{k}": v for k, v in caption_scores(videos, prompts, dets).items()})
    if references is not None:
        out["reference_distance"] = reference_distance(videos, references, paired=True)
    return out
