"""Shared fixtures of the reward tests: tiny VideoReward/base directories, tiny CLIP models, smooth test videos.

Imported by the tests/test_rewards_*.py modules (``from rewards_fixtures import ...``); nothing is downloaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from sage_grpo.rewards.tiny import write_tiny_base, write_tiny_videoreward

TINY_MIN_PIXELS = 28 * 28 * 4  # keeps tiny frames tiny (the real default would upscale 32x48 to ~100k pixels)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """{"base", "old", "new"}: tiny base + VideoReward dirs in the 4.4x ("old") and current ("new") key layouts."""
    root = tmp_path_factory.mktemp("tiny_videoalign")
    base = write_tiny_base(root / "Qwen2-VL-2B-Instruct")
    old = write_tiny_videoreward(root / "VideoReward", base, layout="old")
    new = write_tiny_videoreward(root / "VideoReward_new", base, layout="new")
    return {"base": base, "old": old, "new": new, "root": root}


def smooth_videos(b: int = 3, f: int = 9, h: int = 32, w: int = 48, seed: int = 0) -> torch.Tensor:
    """Deterministic smooth, moving colour gradients float [B, F, 3, H, W] in [0, 1] (codec-friendly)."""
    g = torch.Generator().manual_seed(seed)
    phase = torch.rand(b, 3, generator=g) * 2 * math.pi  # [B, 3]
    freq = 1.0 + torch.rand(b, 3, generator=g) * 2.0  # [B, 3]
    t = torch.arange(f).float().view(1, f, 1, 1, 1) / max(f - 1, 1)
    y = torch.linspace(0, 1, h).view(1, 1, 1, h, 1)
    x = torch.linspace(0, 1, w).view(1, 1, 1, 1, w)
    arg = freq.view(b, 1, 3, 1, 1) * (x + 0.5 * y + 0.6 * t) * math.pi + phase.view(b, 1, 3, 1, 1)
    return 0.5 + 0.4 * torch.sin(arg)  # [B, F, 3, H, W]


def _clip_tokenizer_files(d: Path) -> None:
    """A CLIPTokenizer over byte symbols (+ word-end variants), no merges."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    alpha = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alpha)}
    vocab.update({ch + "</w>": len(alpha) + i for i, ch in enumerate(alpha)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    d.mkdir(parents=True, exist_ok=True)
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n")
    CLIPTokenizer(str(d / "vocab.json"), str(d / "merges.txt")).save_pretrained(str(d))


def write_tiny_clip(d: Path, seed: int, image_size: int = 32, crop: int = 28, mean=None, std=None) -> Path:
    """A tiny random CLIPModel + tokenizer + preprocessor_config.json in ``d``."""
    from transformers import CLIPConfig, CLIPModel

    _clip_tokenizer_files(d)
    torch.manual_seed(seed)
    cfg = CLIPConfig(
        text_config=dict(vocab_size=514, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, eos_token_id=513, bos_token_id=512,
                         pad_token_id=513),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=crop, patch_size=7),
        projection_dim=16,
    )  # fmt: skip
    CLIPModel(cfg).save_pretrained(str(d))
    (d / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "size": {"shortest_edge": image_size},
                "crop_size": {"height": crop, "width": crop},
                "image_mean": mean or [0.48145466, 0.4578275, 0.40821073],
                "image_std": std or [0.26862954, 0.26130258, 0.27577711],
                "do_resize": True,
                "do_center_crop": True,
                "resample": 3,
                "image_processor_type": "CLIPImageProcessor",
            }
        )
    )
    return d


@pytest.fixture(scope="session")
def tiny_clip_dirs(tmp_path_factory) -> dict[str, Path]:
    """{"clip", "pick_model", "pick_processor"}: tiny CLIP dirs (PickScore uses a separate processor dir)."""
    root = tmp_path_factory.mktemp("tiny_clip")
    clip = write_tiny_clip(root / "clip-vit-large-patch14", seed=0)
    pick_model = write_tiny_clip(root / "PickScore_v1", seed=1)
    pick_proc = write_tiny_clip(root / "CLIP-ViT-H-14", seed=2, mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])
    return {"clip": clip, "pick_model": pick_model, "pick_processor": pick_proc, "root": root}
