"""Image-to-video (issue 28): the tiny I2V checkpoint, per-sample image conditioning, parity with diffusers'
HunyuanVideo15ImageToVideoPipeline, per-prompt images in one batch, and the bad-input errors."""

from __future__ import annotations

import json
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


# ------------------------------------------------------------------------------------------------ conditioning

PROMPTS = ["a red ball rolls", 'a sign that says "hi"']


def _image(path, h, w, seed):
    """A smooth random RGB picture h x w saved at `path` (PNG) -> path."""
    import numpy as np
    import PIL.Image

    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, 4, 4, generator=g)
    img = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)[0]
    PIL.Image.fromarray((img.permute(1, 2, 0).numpy() * 255).astype(np.uint8)).save(path)
    return str(path)


@pytest.fixture()
def images(tmp_path):
    """Two different 16:9-ish pictures (same bucket: 24 x 40 px on the tiny model) and a square one."""
    return [_image(tmp_path / "a.png", 36, 64, 1), _image(tmp_path / "b.png", 45, 80, 2),
            _image(tmp_path / "sq.png", 50, 50, 3)]


def test_bucket_sizes_are_the_checkpoints(images):
    from sage_grpo.models.image_cond import bucket_size

    # the 480p buckets (target 640, 16 px VAE patches) of hv15_variants.md's table
    for (h, w), want in {(1080, 1920): (480, 848), (1000, 1000): (640, 640), (1920, 1080): (848, 480),
                         (768, 1024): (544, 720)}.items():
        assert bucket_size(h, w, 640, 16) == want
    assert bucket_size(720, 1280, 960, 16) == (720, 1280)  # 720p
    assert bucket_size(36, 64, 32, 4) == bucket_size(45, 80, 32, 4) == (24, 40)  # the tiny model's
    assert bucket_size(50, 50, 32, 4) == (32, 32)


def test_condition_channels_hold_the_image_in_frame_zero_only(tiny_i2v_pipe, images):
    from sage_grpo.models.image_cond import condition_channels, encode_reference, open_reference_image

    pipe = tiny_i2v_pipe
    im = open_reference_image(images[0])
    c = encode_reference(pipe, im, "cpu", torch.float32)
    assert c.latents.shape == (1, 4, 1, 6, 10) and c.embeds.shape == (1, 4, 16)
    # independently: resize to cover 24 x 40, centre crop, [-1, 1], VAE mode x scaling factor
    import numpy as np
    import PIL.Image

    assert im.width / im.height > 40 / 24  # wider than the bucket: the height fills it (sizes floored)
    big = im.resize((im.width * 24 // im.height, 24), PIL.Image.LANCZOS)
    left, top = big.width // 2 - 20, 0
    crop = big.crop((left, top, left + 40, top + 24))
    px = torch.from_numpy(np.asarray(crop, dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)[None, :, None]
    with torch.no_grad():
        mode = pipe.vae.encode(px).latent_dist.mean * pipe.vae.config.scaling_factor  # a Gaussian's mode is its mean
    torch.testing.assert_close(c.latents, mode, atol=1e-5, rtol=0)
    x = torch.randn(1, 4, 3, 6, 10)
    cond, mask = condition_channels(c, x)
    assert torch.equal(cond[:, :, 0], c.latents[:, :, 0]) and not cond[:, :, 1:].any()
    assert torch.equal(mask[:, :, 0], torch.ones(1, 1, 6, 10)) and not mask[:, :, 1:].any()
    t2v = condition_channels(None, x)
    assert not t2v[0].any() and not t2v[1].any()


def test_ode_rollout_with_an_image_per_prompt_equals_one_pipeline_call_per_image(tiny_i2v_pipe, images):
    """The I2V rollout of a batch whose prompts have different images gives each sample what diffusers'
    HunyuanVideo15ImageToVideoPipeline gives for that prompt and image alone (same noise, steps, CFG): the parity,
    and the authors' one-image-per-batch defect (ref_image_paths[0]) fixed."""
    from sage_grpo.models.image_cond import ImageConditioningCache, open_reference_image
    from sage_grpo.models.text_cache import TextEmbeddingCache
    from sage_grpo.rollout import INIT_NOISE_STEP, SamplerSettings, derive_seed, latent_shape, rollout

    pipe, steps, frames = tiny_i2v_pipe, 4, 5
    text, imgs = TextEmbeddingCache(pipe, "cpu", torch.float32), ImageConditioningCache(pipe, "cpu", torch.float32)
    paths = images[:2]
    imgs.precompute(paths)
    h, w = imgs.latent_hw(paths[0])
    s = pipe.vae.config.spatial_compression_ratio
    settings = SamplerSettings(sde_type="ode", eta=0.0, num_steps=steps, shift=5.0, cfg_scale=6.0)
    traj = rollout(pipe.transformer, text.get(PROMPTS), text.get([""]), prompts=PROMPTS, prompt_ids=torch.arange(2),
                   generation_ids=torch.zeros(2, dtype=torch.long), prompt_seeds=torch.tensor([7, 8]),
                   latent_shape=latent_shape(pipe.vae.config, frames, h * s, w * s), settings=settings,
                   image_tokens=pipe.vision_num_semantic_tokens, base_seed=3, image=imgs.get(paths))
    assert traj.final_latents.shape == (2, 4, 2, 6, 10) and imgs.num_encoded == 2
    assert pipe.scheduler.config.shift == 5.0 and pipe.guider.guidance_scale == 6.0
    refs = []
    for i, (prompt, path) in enumerate(zip(PROMPTS, paths)):
        seed = derive_seed(3, 7 + i, 0, INIT_NOISE_STEP)
        ref = pipe(image=open_reference_image(path), prompt=[prompt], negative_prompt=[""], num_frames=frames,
                   num_inference_steps=steps, generator=[torch.Generator().manual_seed(seed)],
                   output_type="latent").frames
        assert ref.shape == traj.final_latents[i : i + 1].shape and ref.abs().mean() > 0.1
        assert (ref - traj.final_latents[i : i + 1]).abs().max().item() < 1e-5, i
        refs.append(ref)
    # the image matters: sample 1 under sample 0's image (the authors' ref_image_paths[0]) is another video
    wrong = pipe(image=open_reference_image(paths[0]), prompt=[PROMPTS[1]], negative_prompt=[""], num_frames=frames,
                 num_inference_steps=steps, output_type="latent",
                 generator=[torch.Generator().manual_seed(derive_seed(3, 8, 0, INIT_NOISE_STEP))]).frames
    assert (wrong - refs[1]).abs().max() > 1e-2


def test_generate_takes_an_image_per_prompt_and_sizes_the_video_by_its_bucket(tiny_i2v_dir, images, tmp_path):
    import generate
    from sage_grpo.video import read_video

    common = ["--model_path", str(tiny_i2v_dir), "--dtype", "fp32", "--video_length", "5", "--num_inference_steps",
              "2"]
    out = generate.main([*common, "--prompt", "a red ball rolls", "--prompt", "a dog", "--image", images[0],
                         "--image", images[2], "--output_path", str(tmp_path / "gen")])
    sizes = [read_video(p)[0].shape for p in out]
    assert sizes == [(5, 3, 24, 40), (5, 3, 32, 32)]  # each video at its own image's bucket, not --fixed_size
    meta = json.loads((out[1].with_name(out[1].stem + "_config.json")).read_text())
    assert meta["task"] == "i2v" and meta["image"] == images[2]
    # a prompt file's ref_image_path column (relative to the file) gives the same video as --image (index 1: the
    # same noise seed as the second --prompt)
    (tmp_path / "imgs").mkdir()
    shutil.copy(images[2], tmp_path / "imgs" / "sq.png")
    (tmp_path / "p.csv").write_text("prompt,index,ref_image_path\na dog,1,imgs/sq.png\n")
    [by_file] = generate.main([*common, "--valid_video_csv", str(tmp_path / "p.csv"), "--output_path",
                               str(tmp_path / "by_file")])
    assert torch.equal(read_video(by_file)[0], read_video(out[1])[0])
