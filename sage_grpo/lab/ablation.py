"""Grid-cell jobs of scripts/lab_ablation.py, in the package so that spawned worker processes can import them.

Each job returns plain Python rows, cheap to send between processes. Base models are cached per (dim, seed).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..schedule import sigma_schedule
from .data import RingManifold
from .grpo import LabConfig, summarize, train_grpo
from .model import VelocityMLP, pretrain_flow

__all__ = ["PRETRAIN", "base_model", "init_worker", "pretrain_job", "run_job"]

# Pre-training of every base flow of the ablation (part of the cache key).
PRETRAIN = {"steps": 1500, "batch_size": 256, "lr": 1e-2, "hidden": 128, "depth": 3}


def base_model(out: Path, dim: int, seed: int) -> VelocityMLP:
    """The pre-trained flow for (dim, seed), from the cache under out/base/ or trained and cached."""
    path = out / "base" / f"flow_d{dim}_s{seed}.pt"
    meta = {"dim": dim, "seed": seed, **PRETRAIN}
    if path.exists():
        blob = torch.load(path, map_location="cpu", weights_only=True)
        if json.loads(blob["meta"]) == meta:
            model = VelocityMLP(**json.loads(blob["model_config"]))
            model.load_state_dict(blob["state_dict"])
            return model.eval()
    model = pretrain_flow(RingManifold(dim=dim), seed=seed, **PRETRAIN)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"meta": json.dumps(meta), "model_config": json.dumps(model.config()), "state_dict": model.state_dict()}, tmp
    )
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return model


def init_worker() -> None:
    """One intra-op thread per worker: tiny MLPs gain nothing from threads and lose to their synchronisation."""
    torch.set_num_threads(1)


def pretrain_job(job: tuple[Path, int, int]) -> tuple[int, int]:
    out, dim, seed = job
    base_model(out, dim, seed)
    return dim, seed


def run_job(job: tuple[Path, int, LabConfig]) -> dict:
    """One grid cell -> {summary, curves, steps} rows (plain types, cheap to send between processes)."""
    out, dim, cfg = job
    data = RingManifold(dim=dim)
    res = train_grpo(cfg, data, base_model(out, dim, cfg.seed))
    tag = {"dim": dim, "sampler": cfg.sampler, "equalizer": cfg.equalizer, "kl": cfg.kl, "seed": cfg.seed}
    curves = [{**tag, **h} for h in res.history]
    sigmas = sigma_schedule(cfg.num_steps, cfg.shift)  # [T + 1]
    steps = [
        {
            **tag,
            "step": t,
            "sigma": float(sigmas[t]),
            "noise_std": float(res.noise_std[t]),
            "equalizer_weight": float(res.equalizer[t]),
            "predicted_scale": float(res.predicted_scale[t]),
            "grad_norm_start": float(res.grad_norms_start[t]),
        }
        for t in range(cfg.num_steps)
    ]
    return {"summary": {"dim": dim, **summarize(res)}, "curves": curves, "steps": steps}
