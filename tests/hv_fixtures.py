"""Tiny HunyuanVideo-1.5 fixtures: checkpoints written once per session in both layouts (same seed = same weights),
loaded through the real code path. Import the fixtures into a test module: `from hv_fixtures import *`."""

from __future__ import annotations

import pytest
import torch

__all__ = ["tiny_diffusers_dir", "tiny_authors_dir", "tiny_pipe", "text_cache", "TINY_FRAMES", "TINY_H", "TINY_W"]

TINY_FRAMES, TINY_H, TINY_W = 9, 32, 48  # -> latent [4, 3, 8, 12]: 288 video tokens


@pytest.fixture(scope="session")
def tiny_diffusers_dir(tmp_path_factory):
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_diffusers"), "diffusers", seed=0)


@pytest.fixture(scope="session")
def tiny_authors_dir(tmp_path_factory):
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
