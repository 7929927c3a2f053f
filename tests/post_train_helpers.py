"""post_train.py loaded as a module (once: `sys.modules["post_train"]`) and the argument builders of the training
tests (tests/test_post_train.py, tests/test_robustness.py); the `tiny_model` fixture is in tests/conftest.py."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

from sage_grpo.checkpoint import list_checkpoints

ROOT = Path(__file__).resolve().parents[1]
if "post_train" in sys.modules:
    pt = sys.modules["post_train"]
else:
    _spec = importlib.util.spec_from_file_location("post_train", ROOT / "post_train.py")
    pt = importlib.util.module_from_spec(_spec)
    sys.modules["post_train"] = pt  # dataclasses look their module up there
    _spec.loader.exec_module(pt)


def _args(model, out, *extra):
    return ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--model_path", str(model), "--output_dir", str(out),
            "--train_video_csv", str(ROOT / "configs/tiny_prompts.txt"), "--grpo_sampling_steps", "4",
            "--sample_n_frames", "5", "--max_steps", "2", "--save_interval", "0", "--report_to", "none", *extra]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    """The trained transformer of the newest checkpoint, as a plain state dict (a LoRA run's adapter merged)."""
    return checkpoint_weights(list_checkpoints(out)[-1][1])


def checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    """The trained transformer of the checkpoint at `path`, as a plain state dict (a LoRA run's adapter merged)."""
    from sage_grpo.models.loading import load_pipeline
    from sage_grpo.models.lora import load_trained_weights

    cfg = json.loads((path / "train_state.json").read_text())["config"]
    pipe = load_pipeline(model_path=cfg["model"]["model_path"], dtype="fp32", load_text_encoders=False)
    load_trained_weights(pipe.transformer, path)
    return pipe.transformer.state_dict()


def _stable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "mem/"))} for r in rows]


def kill_before_rollout(monkeypatch, proc, at: int = 2):
    """Kill the server process `proc` just before the `at`-th rollout of post_train (pt) starts -> the original
    rollout_phase (to put back for a run that goes on)."""
    orig, calls = pt.rollout_phase, []

    def rollout_phase(c, state, *a):
        calls.append(1)
        if len(calls) == at:
            proc.kill()
            proc.wait()
        return orig(c, state, *a)

    monkeypatch.setattr(pt, "rollout_phase", rollout_phase)
    return orig
