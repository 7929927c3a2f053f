"""Fixtures shared by the test modules (pytest finds them here; no test module imports another). Tiny models are
written once per session and loaded through the real code paths; nothing is downloaded. Plain helpers (sizes,
videos) live in tests/helpers.py; post_train.py as a module and its argument builders in
tests/post_train_helpers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

# ------------------------------------------------------------------------------------------ tiny HunyuanVideo-1.5


@pytest.fixture(scope="session")
def tiny_diffusers_dir(tmp_path_factory):
    """A tiny checkpoint in the diffusers layout (seed 0: the same weights as `tiny_authors_dir`)."""
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_diffusers"), "diffusers", seed=0)


@pytest.fixture(scope="session")
def tiny_authors_dir(tmp_path_factory):
    """The same tiny checkpoint in the authors' layout."""
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_authors"), "authors", seed=0)


@pytest.fixture(scope="session")
def tiny_pipe(tiny_diffusers_dir):
    from sage_grpo.models.loading import load_pipeline

    return load_pipeline(model_path=str(tiny_diffusers_dir), dtype="fp32")


@pytest.fixture()
def text_cache(tiny_pipe):
    from sage_grpo.models.text_cache import TextEmbeddingCache

    return TextEmbeddingCache(tiny_pipe, "cpu", torch.float32)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The model the training tests run (post_train, robustness, bench_step): a diffusers-layout tiny checkpoint in
    a folder of its own (its parent holds nothing else, so it can serve as --pretrained_model_root)."""
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "hv")


# ------------------------------------------------------------------------------------------ tiny reward models


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """{"base", "old", "new"}: tiny base + VideoReward dirs in the 4.4x ("old") and current ("new") key layouts."""
    from sage_grpo.rewards.tiny import write_tiny_base, write_tiny_videoreward

    root = tmp_path_factory.mktemp("tiny_videoalign")
    base = write_tiny_base(root / "Qwen2-VL-2B-Instruct")
    old = write_tiny_videoreward(root / "VideoReward", base, layout="old")
    new = write_tiny_videoreward(root / "VideoReward_new", base, layout="new")
    return {"base": base, "old": old, "new": new, "root": root}


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


def _write_tiny_clip(d: Path, seed: int, image_size: int = 32, crop: int = 28, mean=None, std=None) -> Path:
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
    clip = _write_tiny_clip(root / "clip-vit-large-patch14", seed=0)
    pick_model = _write_tiny_clip(root / "PickScore_v1", seed=1)
    pick_proc = _write_tiny_clip(root / "CLIP-ViT-H-14", seed=2, mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])
    return {"clip": clip, "pick_model": pick_model, "pick_processor": pick_proc, "root": root}


# ------------------------------------------------------------------------------------------ tiny image-to-video


@pytest.fixture(scope="session")
def tiny_i2v_dir(tmp_path_factory):
    """A tiny image-to-video checkpoint (480p_i2v) in the diffusers layout, in a folder of its own."""
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_i2v") / "hv", "diffusers", seed=0, version="480p_i2v")


@pytest.fixture(scope="session")
def tiny_i2v_pipe(tiny_i2v_dir):
    from sage_grpo.models.loading import load_pipeline

    return load_pipeline(model_path=str(tiny_i2v_dir), dtype="fp32")


# ------------------------------------------------------------------------------------------ scheduling

# scripts/test.sh runs the suite on pytest-xdist workers with --dist loadfile: a file runs whole on one worker, so its
# module-scoped fixtures (the shared torchrun launches, the shared training rounds) are built once, not once per
# worker or again each time a worker comes back to the file. The files below (the most CPU, measured on 2 cores,
# one thread per worker) go out first, longest first, so that no long file starts last and leaves a worker idle.
LONGEST_FIRST = (
    "tests/test_world_model.py",
    "tests/test_post_train.py",
    "tests/test_parallel_fsdp.py",  # the fast tier's one torchrun launch: 55 s in one fixture
    "tests/test_launch.py",
    "tests/test_download_weights_hub.py",
    "tests/test_slurm.py",
    "tests/test_resume_layouts.py",
    "tests/test_rewards_judge.py",
    "tests/test_rewards_remote.py",
    "tests/test_robustness.py",
    "tests/test_compile.py",
    "tests/test_real_size_cpu.py",
    "tests/test_gpu_check.py",
    "tests/test_reward_overlap.py",
    "tests/test_bench_reward_balance.py",
    "tests/test_judge_learning.py",
    "tests/test_i2v.py",
    "tests/test_generate.py",
)


def pytest_collection_modifyitems(config, items):
    """Run order: the files of LONGEST_FIRST in that order, then the others as collected; within a file, the
    collected order. Test order carries no meaning (every test builds what it needs from fixtures), so this changes
    only the wall time."""

    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the collected order within each file and among the others
