"""Image-to-video (issue 28): the tiny I2V checkpoint, per-sample image conditioning, parity with diffusers'
HunyuanVideo15ImageToVideoPipeline, per-prompt images in one batch, and the bad-input errors."""

from __future__ import annotations

import shutil

import pytest
import torch

from sage_grpo.errors import SageGRPOError


def test_tiny_i2v_checkpoint_loads_alike_from_both_layouts(tiny_i2v_pipe, tiny_pipe, tmp_path):
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

    from sage_grpo.models.loading import load_pipeline
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    authors = write_tiny_checkpoint(tmp_path / "authors", "authors", seed=0, version="480p_i2v")
    assert (authors / "vision_encoder/siglip/image_encoder/config.json").is_file()
    a = load_pipeline(model_path=str(authors), version="480p_i2v", dtype="fp32")
    for pipe in (tiny_i2v_pipe, a):
        assert isinstance(pipe, HunyuanVideo15ImageToVideoPipeline) and pipe.sage_grpo_task == "i2v"
        assert pipe.transformer.config.task_type == "i2v" and pipe.transformer.config.in_channels == 9  # 2C + 1
    assert type(tiny_pipe) is HunyuanVideo15Pipeline and tiny_pipe.sage_grpo_task == "t2v"
    for mine, theirs in ((tiny_i2v_pipe.transformer, a.transformer), (tiny_i2v_pipe.image_encoder, a.image_encoder)):
        sa, sb = mine.state_dict(), theirs.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    # SigLIP gives the token count the pipeline's text lengths declare, at the transformer's image width
    pixels = torch.rand(1, 3, 28, 28) * 2 - 1
    with torch.no_grad():
        out = tiny_i2v_pipe.image_encoder(pixel_values=pixels).last_hidden_state
    assert out.shape == (1, tiny_i2v_pipe.vision_num_semantic_tokens, tiny_i2v_pipe.transformer.config.image_embed_dim)


def test_an_i2v_checkpoint_without_its_image_encoder_is_named_missing(tiny_i2v_dir, tmp_path):
    from sage_grpo.models.loading import locate_model

    broken = shutil.copytree(tiny_i2v_dir, tmp_path / "hv")
    shutil.rmtree(broken / "image_encoder")
    with pytest.raises(SageGRPOError, match=r"missing:\n  - image_encoder/ \(SigLIP"):
        locate_model(model_path=str(broken))
