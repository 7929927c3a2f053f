"""Image-to-video (issue 28): the tiny I2V checkpoint, per-sample image conditioning, parity with diffusers'
HunyuanVideo15ImageToVideoPipeline, per-prompt images in one batch, and the bad-input errors."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import i2v_prompts, smooth_image

from sage_grpo.errors import SageGRPOError

REPO = Path(__file__).resolve().parents[1]


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


@pytest.fixture()
def images(tmp_path):
    """Two different 16:9-ish pictures (same bucket: 24 x 40 px on the tiny model) and a square one."""
    return [smooth_image(tmp_path / "a.png", 36, 64, 1), smooth_image(tmp_path / "b.png", 45, 80, 2),
            smooth_image(tmp_path / "sq.png", 50, 50, 3)]


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
    # the held-out metric's view of the reference: the same crop at the video's size, in [0, 1]
    from sage_grpo.models.image_cond import reference_pixels

    want = torch.from_numpy(np.asarray(crop, dtype=np.float32) / 255).permute(2, 0, 1)
    assert torch.equal(reference_pixels(images[0], 24, 40), want)
    x = torch.randn(1, 4, 3, 6, 10)
    cond, mask = condition_channels(c, x)
    assert torch.equal(cond[:, :, 0], c.latents[:, :, 0]) and not cond[:, :, 1:].any()
    assert torch.equal(mask[:, :, 0], torch.ones(1, 1, 6, 10)) and not mask[:, :, 1:].any()
    t2v = condition_channels(None, x)
    assert not t2v[0].any() and not t2v[1].any()


def test_image_cache_encodes_once_shares_its_files_and_notices_an_edited_image(tiny_i2v_pipe, images, tmp_path):
    from sage_grpo.models.image_cond import ImageConditioningCache, encode_reference, open_reference_image

    pipe = tiny_i2v_pipe
    a = ImageConditioningCache(pipe, "cpu", torch.float32, tmp_path / "cache")
    a.precompute([images[0], images[1], images[0]])
    assert a.num_encoded == 2 and len(list((tmp_path / "cache").glob("image-*.safetensors"))) == 2
    got = a.get([images[1], images[0]])  # [2, ...] in the asked order
    for i, path in enumerate([images[1], images[0]]):
        want = encode_reference(pipe, open_reference_image(path), "cpu", torch.float32)
        assert torch.equal(got.latents[i], want.latents[0]) and torch.equal(got.embeds[i], want.embeds[0])
    b = ImageConditioningCache(pipe, "cpu", torch.float32, tmp_path / "cache")  # another rank or run: reads the files
    again = b.get([images[1], images[0]])
    assert b.num_encoded == 0 and torch.equal(again.latents, got.latents) and torch.equal(again.embeds, got.embeds)
    shutil.copy(images[1], images[0])  # the image at a path changed: encoded again, not the stale entry
    assert torch.equal(b.get([images[0]]).embeds, got.embeds[:1]) and b.num_encoded == 1
    with pytest.raises(SageGRPOError, match="one forward holds one size"):
        a.get([images[0], images[2]])  # a 16:9 and a square image do not stack


def test_first_frame_fidelity_and_the_reference_metrics_group():
    from sage_grpo.heldout import HeldOut, first_frame_fidelity, parse_validation_metrics
    from sage_grpo.rewards import build_reward

    g = torch.Generator().manual_seed(0)
    image = torch.rand(3, 8, 12, generator=g)
    frames = torch.rand(5, 3, 8, 12, generator=g)
    assert first_frame_fidelity(torch.cat([image[None], frames[1:]]), image) == pytest.approx(1.0)
    rmse = float(((frames[0] - image) ** 2).mean().sqrt())  # independently: the root mean square over every pixel
    assert first_frame_fidelity(frames, image) == pytest.approx(1 - rmse, abs=1e-6)
    assert first_frame_fidelity(torch.zeros(2, 3, 8, 12), torch.ones(3, 8, 12)) == pytest.approx(0.0)
    # auto adds it for prompts with reference images only; asked for without images it is one error
    assert "reference" in parse_validation_metrics(["auto"], ["brightness"], ["a cat"], has_images=True).groups
    assert "reference" not in parse_validation_metrics(["auto"], ["brightness"], ["a cat"]).groups
    with pytest.raises(SageGRPOError, match="reference compares each video's first frame"):
        parse_validation_metrics(["reference"], ["brightness"], ["a cat"])
    held = HeldOut(parse_validation_metrics(["reference", "statistics"], ["brightness"], ["a cat"], has_images=True),
                   build_reward("brightness", reward_weights={"brightness": 1.0}))
    assert held.senses["first_frame_fidelity"] == 1 and held.senses["motion"] == 0  # a freezing video warns too
    out = held.score(frames, "a cat", {"brightness": 0.5, "total": 0.5}, None, image)
    assert out["first_frame_fidelity"] == pytest.approx(1 - rmse, abs=1e-6)
    assert math.isnan(held.score(frames, "a cat", {}, None, None)["first_frame_fidelity"])


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


def test_image_cache_notices_an_image_edited_only_in_the_middle(tiny_i2v_pipe, tmp_path):
    import numpy as np
    import PIL.Image

    from sage_grpo.models.image_cond import ImageConditioningCache

    # an uncompressed 3 MiB BMP: repainting its middle rows keeps the file's size and its first and last MiB
    pixels = np.full((1024, 1024, 3), 90, dtype=np.uint8)
    path = tmp_path / "big.bmp"
    PIL.Image.fromarray(pixels).save(path)
    before = path.read_bytes()
    cache = ImageConditioningCache(tiny_i2v_pipe, "cpu", torch.float32, tmp_path / "cache")
    old = cache.get([str(path)])
    pixels[448:576] = 200
    PIL.Image.fromarray(pixels).save(path)
    after, mib = path.read_bytes(), 1 << 20
    assert len(after) == len(before) > 2 * mib and after[:mib] == before[:mib] and after[-mib:] == before[-mib:]
    new = cache.get([str(path)])
    assert cache.num_encoded == 2 and not torch.equal(new.latents, old.latents)


def test_a_reference_image_is_turned_upright_by_its_exif_orientation(tiny_i2v_pipe, tmp_path):
    import numpy as np
    import PIL.Image
    from diffusers.utils import load_image

    from sage_grpo.models.image_cond import ImageConditioningCache, open_reference_image

    # a phone's portrait photo: landscape pixels (36 x 64) and EXIF Orientation 6 (rotate 90 degrees clockwise)
    landscape = PIL.Image.open(smooth_image(tmp_path / "l.png", 36, 64, 4))
    exif = PIL.Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "portrait.jpg"
    landscape.save(path, exif=exif, quality=95)
    upright = open_reference_image(path)
    assert upright.size == (36, 64)  # width x height: portrait
    assert np.array_equal(np.asarray(upright), np.asarray(load_image(str(path))))  # diffusers' reading
    cache = ImageConditioningCache(tiny_i2v_pipe, "cpu", torch.float32)
    assert cache.latent_hw(str(path)) == (10, 6)  # the portrait bucket 40 x 24, not the landscape 24 x 40


def test_the_reference_latent_is_the_whole_encoding_whatever_the_decode_tiling(tiny_i2v_pipe, images, tmp_path,
                                                                                 monkeypatch):
    from types import SimpleNamespace

    from diffusers import HunyuanVideo15ImageToVideoPipeline

    from sage_grpo.models.image_cond import ImageConditioningCache, image_encoder_identity, open_reference_image

    pipe, path = tiny_i2v_pipe, images[1]  # bucket 24 x 40
    crop = pipe.video_processor.resize(open_reference_image(path), height=24, width=40, resize_mode="crop")

    def diffusers_latent():  # diffusers' I2V pipeline's condition latent, with the VAE as it is now
        return HunyuanVideo15ImageToVideoPipeline._get_image_latents(pipe.vae, pipe.video_processor, crop, 24, 40,
                                                                     "cpu")

    whole = diffusers_latent()  # the VAE as loaded: untiled
    cache = ImageConditioningCache(pipe, "cpu", torch.float32, tmp_path / "cache")
    untiled = cache.get([path])
    # --vae_tiling on, with tiles smaller than the tiny crop (the real VAE's are 256 px: a 480 x 848 image is tiled)
    for name, value in (("use_tiling", True), ("tile_sample_min_height", 16), ("tile_sample_min_width", 16),
                        ("tile_latent_min_height", 4), ("tile_latent_min_width", 4)):
        monkeypatch.setattr(pipe.vae, name, value)
    assert not torch.allclose(diffusers_latent(), whole, atol=1e-4)  # tiling does change a latent
    fresh = ImageConditioningCache(pipe, "cpu", torch.float32)  # encodes again, under the tiling
    tiled = fresh.get([path])
    assert fresh.num_encoded == 1 and torch.allclose(tiled.latents, whole, atol=1e-6, rtol=0)
    assert torch.equal(tiled.latents, untiled.latents) and torch.equal(tiled.embeds, untiled.embeds)
    assert pipe.vae.use_tiling  # the decode keeps its tiling
    again = ImageConditioningCache(pipe, "cpu", torch.float32, tmp_path / "cache")  # the same files serve both
    assert torch.equal(again.get([path]).latents, untiled.latents) and again.num_encoded == 0
    # what does change the latent changes the key: the VAE's dtype
    bf16 = SimpleNamespace(sage_grpo_location=pipe.sage_grpo_location, transformer=pipe.transformer,
                           vae=SimpleNamespace(dtype=torch.bfloat16))
    assert image_encoder_identity(bf16) != image_encoder_identity(pipe)


def test_generate_tiles_the_decode_as_training_does_not_by_fixed_size(tiny_i2v_dir, images, tmp_path, monkeypatch):
    import generate
    from sage_grpo.config import Config
    from sage_grpo.models import loading

    loaded = []
    load = loading.load_pipeline
    monkeypatch.setattr(loading, "load_pipeline", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    common = ["--model_path", str(tiny_i2v_dir), "--dtype", "fp32", "--video_length", "1", "--num_inference_steps",
              "1", "--fixed_size", "64x64", "--prompt", "a red ball rolls", "--image", images[0]]
    generate.main([*common, "--output_path", str(tmp_path / "a")])
    generate.main([*common, "--vae_tiling", "False", "--output_path", str(tmp_path / "b")])
    # post_train.py tiles when model.vae_tiling (default on); a small --fixed_size is no reason not to (an I2V
    # video takes its image's size)
    assert [p.vae.use_tiling for p in loaded] == [Config().model.vae_tiling, False] == [True, False]


def test_generate_takes_an_image_per_prompt_and_sizes_the_video_by_its_bucket(tiny_i2v_dir, images, tmp_path):
    import generate
    from sage_grpo.data import PromptRecord
    from sage_grpo.generation import record_noise_seed
    from sage_grpo.video import read_video

    common = ["--model_path", str(tiny_i2v_dir), "--dtype", "fp32", "--video_length", "5", "--num_inference_steps",
              "2"]
    out = generate.main([*common, "--prompt", "a red ball rolls", "--prompt", "a dog", "--image", images[0],
                         "--image", images[2], "--output_path", str(tmp_path / "gen")])
    sizes = [read_video(p)[0].shape for p in out]
    assert sizes == [(5, 3, 24, 40), (5, 3, 32, 32)]  # each video at its own image's bucket, not --fixed_size
    meta = json.loads((out[1].with_name(out[1].stem + "_config.json")).read_text())
    assert meta["task"] == "i2v" and meta["image"] == images[2]
    assert meta["noise_seed"] == record_noise_seed(PromptRecord("a dog", 1, ref_image_path=images[2]))
    # a prompt file's ref_image_path column (relative to the file, or absolute) gives the same videos as --image
    # (the indices: the same noise seeds as the --prompt order), its images of two sizes each at its own
    (tmp_path / "imgs").mkdir()
    shutil.copy(images[2], tmp_path / "imgs" / "sq.png")
    (tmp_path / "p.csv").write_text(f"prompt,index,ref_image_path\na dog,1,imgs/sq.png\n"
                                    f"a red ball rolls,0,{images[0]}\n")
    by_file = generate.main([*common, "--valid_video_csv", str(tmp_path / "p.csv"), "--output_path",
                             str(tmp_path / "by_file")])
    assert len(by_file) == 2
    assert torch.equal(read_video(by_file[0])[0], read_video(out[1])[0])
    assert torch.equal(read_video(by_file[1])[0], read_video(out[0])[0])


def test_rows_with_one_caption_and_seed_but_other_images_start_from_other_noise(tiny_i2v_pipe, images, tmp_path,
                                                                               monkeypatch):
    """sample_videos (generate.py, validation): two image-to-video rows with one caption and one seed column but
    different images start from different noise; the first image copied to another path starts from the first's
    noise (the image's content counts, not where it lies). Seen failing when the noise seed leaves the image out
    (prompt_noise_seed(rec.prompt, rec.seed, rec.index)): "rows with other images start from the same noise"."""
    import sage_grpo.rollout as rollout_mod
    from sage_grpo.data import PromptRecord
    from sage_grpo.generation import sample_videos
    from sage_grpo.models.image_cond import ImageConditioningCache
    from sage_grpo.models.text_cache import TextEmbeddingCache
    from sage_grpo.rollout import SamplerSettings, latent_shape

    starts, real = [], rollout_mod.rollout

    def spy(*args, **kwargs):
        traj = real(*args, **kwargs)
        starts.append(traj.latents[0, 0])  # x_0 [C, F, h, w]
        return traj

    monkeypatch.setattr(rollout_mod, "rollout", spy)
    (tmp_path / "copy").mkdir()
    paths = [images[0], images[1], shutil.copy(images[0], tmp_path / "copy" / "a.png")]
    recs = [PromptRecord(PROMPTS[0], i, seed=1, ref_image_path=str(p)) for i, p in enumerate(paths)]
    pipe = tiny_i2v_pipe
    list(sample_videos(pipe, TextEmbeddingCache(pipe, "cpu", torch.float32), recs,
                       settings=SamplerSettings(sde_type="ode", eta=0.0, num_steps=1, shift=5.0, cfg_scale=1.0),
                       shape=latent_shape(pipe.vae.config, 5, 16, 16), base_seed=930, negative_prompt="",
                       decode=False, images=ImageConditioningCache(pipe, "cpu", torch.float32)))
    assert len(starts) == 3
    assert not torch.equal(starts[0], starts[1]), "rows with other images start from the same noise"
    assert torch.equal(starts[0], starts[2])


# ------------------------------------------------------------------------------------------------ training


@pytest.mark.slow
def test_i2v_training_starts_at_ratio_one_validates_and_resumes_exactly(tiny_i2v_dir, tmp_path):
    from post_train_helpers import _args, _stable, _weights, pt

    from sage_grpo.checkpoint import list_checkpoints
    from sage_grpo.metrics import read_metrics

    csv = i2v_prompts(tmp_path / "data")
    # two prompts (two images) per step on the one rank: each group must get its own image
    extra = ["--train_video_csv", str(csv), "--num_generations", "2", "--update_ref_model_step", "1",
             "--kl_warmup_updates", "1", "--kl_weight", "1e-2", "--kl_coef", "1e-3", "--kl_min_coef", "1e-4",
             "--learning_rate", "1e-3", "--validation_num_inference_steps", "2", "--validate_video_length", "5"]
    full, half = tmp_path / "full", tmp_path / "half"
    pt.main(_args(tiny_i2v_dir, full, "--max_steps", "4", "--validation_interval", "2", *extra))
    pt.main(_args(tiny_i2v_dir, half, "--max_steps", "2", "--save_interval", "2", "--validation_interval", "2",
                  *extra))
    pt.main(_args(tiny_i2v_dir, half, "--max_steps", "4", "--save_interval", "2", "--validation_interval", "2",
                  *extra, "--resume_from_checkpoint", "latest"))
    rows = read_metrics(full / "metrics.jsonl")
    assert rows[0]["train/ratio_min"] == rows[0]["train/ratio_max"] == 1.0  # re-scored with the rollout's images
    assert rows[1]["val/videos"] == 4 and len(list((full / "samples" / "step_000002").glob("*.mp4"))) == 4
    assert 0 < rows[1]["val/first_frame_fidelity"] < 1 and "val_shift/first_frame_fidelity" in rows[1]
    a, b = (list_checkpoints(d)[-1][1] for d in (full, half))
    sa, sb = (json.loads((p / "train_state.json").read_text()) for p in (a, b))
    assert sa["step"] == sb["step"] == 4 and sa["task"] == "i2v"  # for the export's model card
    assert {k: v for k, v in sa.items() if k != "config"} == {k: v for k, v in sb.items() if k != "config"}
    wa, wb = _weights(full), _weights(half)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert _stable(read_metrics(full / "metrics.jsonl")) == _stable(read_metrics(half / "metrics.jsonl"))


def test_i2v_training_rollout_gives_each_group_its_own_image_and_rescores_to_ratio_one(tiny_i2v_dir, tmp_path):
    """post_train's setup and rollout phase on the tiny I2V model: two prompts (two images) on one rank, each
    sample conditioned on its own prompt's image (the authors' code gave the rank the first group's image), encoded
    once per image; re-scoring the stored trajectory (the update's forward) gives the rollout's log-probs back."""
    from post_train_helpers import _args, pt

    from sage_grpo.config import load_config
    from sage_grpo.models.image_cond import encode_reference, open_reference_image
    from sage_grpo.parallel.dist import init_distributed
    from sage_grpo.rollout import policy_step

    csv = i2v_prompts(tmp_path / "data")
    cfg = load_config(_args(tiny_i2v_dir, tmp_path / "run", "--train_video_csv", str(csv), "--num_generations", "2",
                            "--grpo_sampling_steps", "2"))
    c, state = pt.setup(cfg, init_distributed(), None)
    assert c.images is not None and c.images.num_encoded == 4 and c.shape == (4, 2, 6, 10)
    traj = pt.rollout_phase(c, state)
    prompts = sorted(set(traj.prompts))
    assert len(prompts) == 2 and traj.image is not None and len(traj.image) == 4
    by_prompt = {r.prompt: r.ref_image_path for r in c.prompts}
    for i, prompt in enumerate(traj.prompts):
        want = encode_reference(c.pipe, open_reference_image(by_prompt[prompt]), "cpu", torch.float32)
        assert torch.equal(traj.image.embeds[i], want.embeds[0]) and torch.equal(traj.image.latents[i], want.latents[0])
    assert not torch.equal(traj.image.embeds[0], traj.image.embeds[2])  # the two groups' images differ
    with torch.no_grad():  # in the rollout's chunks, as the update re-scores (a matmul's rounding depends on them)
        for chunk in torch.arange(4).split(cfg.optim.mini_batch_size_per_update):
            for step in range(2):
                out = policy_step(c.transformer, traj, chunk, step, c.pipe.vision_num_semantic_tokens)
                assert torch.equal(out.log_prob, traj.log_probs[chunk, step])


def _two_size_prompts(folder):
    """A prompt CSV whose images fall into two buckets of the tiny model, alternating in the file: 16:9-ish (24 x 40
    px videos) and square (32 x 32)."""
    (folder / "imgs").mkdir(parents=True, exist_ok=True)
    rows = ["prompt,ref_image_path"]
    for i in range(4):
        h, w = (36 + i, 64 + 2 * i) if i % 2 == 0 else (50 + i, 50 + i)
        smooth_image(folder / "imgs" / f"{i}.png", h, w, 20 + i)
        rows.append(f"a scene number {i},imgs/{i}.png")
    (folder / "prompts.csv").write_text("\n".join(rows) + "\n")
    return folder / "prompts.csv"


@pytest.fixture(scope="module")
def two_size_lora_run(tiny_i2v_dir, tmp_path_factory):
    """A LoRA run of the tiny I2V model on images of two sizes: 2 steps of 2 prompts, a checkpoint after each,
    validation at step 2 (the 4 prompts, both sizes); and the same run resumed from its checkpoint-1 in another
    folder. -> {"full", "resumed": output dirs, "latents": {run: [the rollout latent shape of each step]}, "csv"}."""
    from post_train_helpers import _args, pt

    root = tmp_path_factory.mktemp("two_sizes")
    csv = _two_size_prompts(root / "data")
    extra = ["--train_video_csv", str(csv), "--num_generations", "2", "--use_lora", "True", "--lora_r", "4",
             "--learning_rate", "3e-2", "--kl_warmup_updates", "1", "--kl_weight", "1e-2", "--save_interval", "1",
             "--validation_interval", "2", "--validation_num_inference_steps", "2", "--validate_video_length", "5"]
    latents: dict = {}

    def run(name, *more):
        def recording(c, state, *a, **k):  # the rollout latents of each step, as the update receives them
            traj = rollout_phase(c, state, *a, **k)
            latents.setdefault(name, []).append(tuple(traj.latents.shape))
            return traj

        rollout_phase = pt.rollout_phase
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pt, "rollout_phase", recording)
            pt.main(_args(tiny_i2v_dir, root / name, *extra, *more))

    run("full")
    run("resumed", "--resume_from_checkpoint", str(root / "full" / "checkpoint-1"))
    return {"full": root / "full", "resumed": root / "resumed", "latents": latents, "csv": csv}


@pytest.mark.slow
def test_i2v_images_of_two_sizes_train_one_size_per_step_and_resume_exactly(two_size_lora_run):
    """Mixed image sizes in one run: each step's rollout batch holds one size (the sampler draws a step's prompts
    from one bucket), both sizes are trained within the 2 steps, validation renders each prompt at its own size,
    and a resume from checkpoint-1 gives step 2 bitwise (the LoRA adapter, the train state, the metrics)."""
    from post_train_helpers import _stable
    from safetensors.torch import load_file

    from sage_grpo.metrics import read_metrics
    from sage_grpo.video import read_video

    run = two_size_lora_run
    shapes = run["latents"]["full"]  # [B, T + 1, C, F, h, w] per step
    assert len(shapes) == 2 and {s[-2:] for s in shapes} == {(6, 10), (8, 8)}, shapes  # 24x40 and 32x32 videos
    assert run["latents"]["resumed"] == shapes[1:]
    full, resumed = read_metrics(run["full"] / "metrics.jsonl"), read_metrics(run["resumed"] / "metrics.jsonl")
    assert full[0]["train/ratio_min"] == full[0]["train/ratio_max"] == 1.0
    sizes = sorted(read_video(p)[0].shape[-2:] for p in (run["full"] / "samples" / "step_000002").glob("*.mp4"))
    assert sizes == [(24, 40), (24, 40), (32, 32), (32, 32)]
    assert _stable(full)[-1] == _stable(resumed)[-1] and resumed[-1]["step"] == 2
    a, b = (d / "checkpoint-2" for d in (run["full"], run["resumed"]))
    sa, sb = (json.loads((p / "train_state.json").read_text()) for p in (a, b))
    assert sa["sampler"] == sb["sampler"] and sa["sampler"]["steps"] == 2  # the bucketed sampler's state
    assert {k: v for k, v in sa.items() if k != "config"} == {k: v for k, v in sb.items() if k != "config"}
    la, lb = (load_file(p / "lora" / "adapter_model.safetensors") for p in (a, b))
    assert la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)


@pytest.mark.slow
def test_i2v_lora_checkpoint_exports_and_generates_from_the_trained_weights(two_size_lora_run, tiny_i2v_dir,
                                                                            tmp_path):
    """The I2V LoRA run's checkpoint, exported by scripts/export_checkpoint.py as an adapter (peft) and as merged
    weights, samples with generate.py --image: both exports give the same video (up to float rounding), at the
    image's bucket, unlike the base model's, and the merged export the checkpoint's own video; the adapter's model
    card is the image-to-video one."""
    import sys
    from pathlib import Path

    import generate
    from sage_grpo.video import read_video

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import export_checkpoint

    ckpt = two_size_lora_run["full"] / "checkpoint-2"
    # a LoRA checkpoint holds the adapter, not a merged copy of the base (16.6 GB at the real size)
    assert (ckpt / "lora" / "adapter_model.safetensors").is_file() and not (ckpt / "transformer").exists()
    adapter = export_checkpoint.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "peft"), "--lora_format",
                                      "peft"])
    merged = export_checkpoint.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "merged")])
    assert "pipeline_tag: image-to-video" in (adapter / "README.md").read_text()
    image = str(two_size_lora_run["csv"].parent / "imgs" / "1.png")  # a square one: a 32 x 32 video
    common = ["--model_path", str(tiny_i2v_dir), "--dtype", "fp32", "--video_length", "5", "--num_inference_steps",
              "2", "--prompt", "a scene number 1", "--image", image]
    videos = {}
    runs = {"base": [], "lora": ["--lora_path", str(adapter)], "merged": ["--checkpoint_path", str(merged)],
            "checkpoint": ["--checkpoint_path", str(ckpt)]}  # the last: the training checkpoint itself (DCP)
    for name, more in runs.items():
        [path] = generate.main([*common, *more, "--output_path", str(tmp_path / f"{name}.mp4")])
        videos[name] = read_video(path)[0]  # [F, 3, H, W] in [0, 1], 8-bit levels
    assert videos["lora"].shape == (5, 3, 32, 32)
    assert (videos["lora"] - videos["merged"]).abs().max() <= 2 / 255  # the same weights, merged or not
    assert torch.equal(videos["checkpoint"], videos["merged"])  # the export holds the checkpoint's weights
    assert (videos["lora"] - videos["base"]).abs().max() > 8 / 255  # the trained adapter changes the video


# ------------------------------------------------------------------------------------------------ bad input


@pytest.fixture()
def no_model_load(monkeypatch):
    """Fail the test if anything loads the pipeline: the errors below must come first."""
    import sage_grpo.models.loading as loading

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(loading, "load_pipeline", refuse)


def _csv(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "p.csv").write_text("prompt,ref_image_path\n" + "".join(f"{p},{i}\n" for p, i in rows))
    return str(folder / "p.csv")


def test_bad_reference_images_and_tasks_are_one_line_before_any_model_loads(tiny_i2v_dir, tiny_model, images,
                                                                             tmp_path, no_model_load):
    from post_train_helpers import _args, pt

    d = tmp_path / "data"
    d.mkdir()
    (d / "junk.png").write_bytes(b"not an image at all")
    png = (tmp_path / "a.png").read_bytes()
    (d / "cut.png").write_bytes(png[: len(png) // 2])  # a truncated download
    cases = [
        (tiny_i2v_dir, _csv(d / "1", [("a cat", "gone.png")]), r"reference image .*1/gone.png \(--train_video_csv .*"
         r"prompt 'a cat'\) does not exist"),
        (tiny_i2v_dir, _csv(d / "2", [("a cat", "../junk.png")]), r"junk.png .* cannot be read as an image"),
        (tiny_i2v_dir, _csv(d / "3", [("a cat", "../cut.png")]), r"cut.png .* (cannot be read as an image|is corrupt)"),
        (tiny_i2v_dir, _csv(d / "4", [("a cat", images[0]), ("a dog", "")]), r"mixes tasks"),
        (tiny_model, _csv(d / "5", [("a cat", images[0])]), r"gives reference images .* but the checkpoint is "
         r"text-to-video"),
        (tiny_i2v_dir, "configs/tiny_prompts.txt", r"the checkpoint is image-to-video but --train_video_csv "
         r"configs/tiny_prompts.txt gives no reference image for"),
    ]
    for model, csv, match in cases:
        with pytest.raises(SageGRPOError, match=match) as err:
            pt.main(_args(model, tmp_path / "run", "--train_video_csv", csv))
        # one line, or the preflight's one message of several (a heading, then one bullet line each)
        lines = str(err.value).splitlines()
        assert len(lines) == 1 or (lines[0].endswith("before the run can start:")
                                   and all(x.startswith("  - ") for x in lines[1:]))
    # validation prompts without images on an I2V checkpoint (the training file has them)
    with pytest.raises(SageGRPOError, match="image-to-video but --validation_prompts gives no reference image"):
        pt.main(_args(tiny_i2v_dir, tmp_path / "run", "--train_video_csv", _csv(d / "6", [("a cat", images[0])]),
                      "--validation_interval", "1", "--validation_prompts", "a dog"))


def test_generate_refuses_bad_images_before_any_model_loads(tiny_i2v_dir, tiny_model, images, tmp_path,
                                                            no_model_load):
    import generate

    out = ["--output_path", str(tmp_path / "o")]
    cases = [
        (["--model_path", str(tiny_i2v_dir), "--prompt", "x", "--image", str(tmp_path / "nope.png")], "does not exist"),
        (["--model_path", str(tiny_model), "--prompt", "x", "--image", images[0]], "the checkpoint is text-to-video"),
        (["--model_path", str(tiny_i2v_dir), "--prompt", "x"], "image-to-video but --prompt/--image gives no"),
        (["--model_path", str(tiny_i2v_dir), "--prompt", "x", "--prompt", "y", "--prompt", "z", "--image", images[0],
          "--image", images[1]], "2 --image for 3 --prompt"),
        (["--model_path", str(tiny_i2v_dir), "--prompt_file", "configs/tiny_prompts.txt", "--image", images[0]],
         "--image goes with --prompt"),
    ]
    for argv, match in cases:
        with pytest.raises(SageGRPOError, match=re.escape(match)):
            generate.main([*argv, *out])


def test_an_i2v_training_checkpoint_samples_on_its_base_and_refuses_a_t2v_one(tiny_i2v_dir, tiny_model, images,
                                                                            tmp_path, monkeypatch, capsys):
    """generate.py --checkpoint_path of an image-to-video run takes the run's base (its saved config) without
    --config; a text-to-video base named for it (a flag, or a --config of a T2V model such as configs/tiny_world.yaml:
    the same shapes would sample silently), also where the run's base has moved, is one line before any model loads."""
    from helpers import lora_checkpoint

    import generate
    from sage_grpo.errors import run_cli
    from sage_grpo.models import loading

    settings = dict(dtype="fp32", validate_video_length=5, validation_num_inference_steps=2)
    ckpt = lora_checkpoint(tmp_path / "run", tiny_i2v_dir, "i2v", **settings)
    [path] = generate.main(["--checkpoint_path", str(ckpt), "--prompt", "a red ball rolls", "--image", images[0],
                            "--output_path", str(tmp_path / "v.mp4")])
    meta = json.loads((tmp_path / "v_config.json").read_text())
    assert meta["task"] == "i2v" and meta["weights"] == str(tiny_i2v_dir) and meta["frames"] == 5

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the base model was checked")

    monkeypatch.setattr(loading, "load_pipeline", refuse)
    monkeypatch.chdir(REPO)  # configs/tiny_world.yaml names its model relative to the repository
    moved = lora_checkpoint(tmp_path / "moved", tmp_path / "gone", "i2v", **settings,
                            transformer=loading.load_transformer(loading.locate_model(model_path=str(tiny_i2v_dir)),
                                                                 torch.float32))
    world = "assets/tiny_world/hunyuanvideo15"  # as the config names it
    cases = [(["--checkpoint_path", str(ckpt), "--model_path", str(tiny_model)], f"was trained on {tiny_i2v_dir} "
              f"(image-to-video), not on {tiny_model} (text-to-video) (--model_path)"),
             (["--checkpoint_path", str(ckpt), "--config", "configs/tiny_world.yaml"], f"not on {world} "
              "(text-to-video) (model.model_path/pretrained_model_root of --config configs/tiny_world.yaml)"),
             (["--checkpoint_path", str(moved), "--model_path", str(tiny_model)], "holds image-to-video weights but "
              f"--model_path names {tiny_model} (text-to-video); pass the base model it was trained on")]
    for argv, match in cases:
        with pytest.raises(SystemExit) as e:
            run_cli(generate.main, [*argv, "--prompt", "x", "--image", images[0], "--output_path",
                                    str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and match in err, err


# 2-rank layouts with I2V (as tests/test_post_train.py LAYOUTS for T2V): -> (flags of the 2-rank run, flags shared
# with the one-process reference, which runs the same 4 videos per step). AdamW under FSDP2, as there.
I2V_LAYOUTS = {
    "sp2": (["--sp_size", "2", "--batch_size", "4", "--enable_fsdp", "False"], []),
    "fsdp_dp2": (["--batch_size", "2", "--enable_fsdp", "True"], ["--use_muon", "False"]),
}


@pytest.fixture(scope="module")
def two_rank_launch(tiny_i2v_dir, tmp_path_factory):
    """The module's 2-rank work in one torchrun launch on 2 gloo ranks (tests/dist_workers/run_workers.py): the image
    cache's shared precompute (image_cache_worker.py, into `cache/`), then the I2V_LAYOUTS training runs
    (post_train_runs_worker.py, into `<layout>/`) -> (root folder, the launch's stdout, the runs' shared flags)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    root = tmp_path_factory.mktemp("i2v_two_rank")
    sizes = (("a.png", 36, 64, 1), ("b.png", 45, 80, 2), ("sq.png", 50, 50, 3))  # as the `images` fixture's
    a, b, sq = (str(smooth_image(root / name, h, w, seed)) for name, h, w, seed in sizes)
    (root / "cache").mkdir()
    csv = _two_size_prompts(root / "data")
    common = ["--config", str(repo / "configs/tiny_cpu.yaml"), "--model_path", str(tiny_i2v_dir), "--train_video_csv",
              str(csv), "--num_generations", "2", "--grpo_sampling_steps", "3", "--sample_n_frames", "5",
              "--max_steps", "2", "--save_interval", "0", "--report_to", "none"]
    runs = [[*common, *shared, *two, "--output_dir", str(root / name)] for name, (two, shared) in I2V_LAYOUTS.items()]
    (root / "runs.json").write_text(json.dumps(runs))
    workers = [["image_cache_worker.py", str(root / "cache"), str(tiny_i2v_dir), str(root / "cache" / "files"), a,
                str(root / "gone.png"), b, sq],
               ["post_train_runs_worker.py", str(root / "runs.json")]]
    (root / "workers.json").write_text(json.dumps(workers))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(repo / "tests/dist_workers/run_workers.py"), str(root / "workers.json")],
                       capture_output=True, text=True, cwd=repo, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return root, r.stdout, common


@pytest.mark.dist
def test_image_cache_precompute_is_shared_by_two_ranks(two_rank_launch):
    """Under torchrun each distinct image is encoded by one rank and read by the others from the cache directory;
    a bad image on one rank's share ends with one error on every rank instead of a hang."""
    root = two_rank_launch[0] / "cache"
    ranks = [json.loads((root / f"rank{i}.json").read_text()) for i in range(2)]
    assert [x["encoded"] for x in ranks] == [2, 1]
    for x in ranks:
        assert x["equal"] and x["encoded_after_get"] == x["encoded"] and x["files"] == 3
        assert re.search(r"failed on 1 rank\(s\); rank 1: reference image .*gone.png does not exist",
                         x["failure_error"])


@pytest.mark.dist
def test_two_rank_i2v_layouts_match_one_process(two_rank_launch):
    """torchrun on 2 gloo ranks with the tiny I2V model, 2 prompts (2 images) per step: Ulysses sp 2 (the 4 image
    tokens go through the all-to-all with the text) and FSDP2 dp 2 (one group, one image per rank), 2 steps each,
    against one process with the same 4 videos per step: the same rollouts, rewards and gradients up to float
    rounding. The images have two sizes (the steps draw from both buckets): each rank, computing the plan alone,
    draws the step's bucket of the one process."""
    from post_train_helpers import pt

    from sage_grpo.config import load_config
    from sage_grpo.data import GroupSampler
    from sage_grpo.metrics import read_metrics

    tmp_path, stdout, common = two_rank_launch
    sizes = "image-to-video: 4 reference images, training videos in 2 size buckets: 24x40 (2 prompts), 32x32 (2"
    assert stdout.count(sizes) == len(I2V_LAYOUTS), stdout
    plan = GroupSampler(4, batch_size=4, num_generations=2, dp_size=1, seed=load_config(common).optim.seed,
                        buckets=["wide", "square"] * 2)  # the file's buckets, in its order
    assert plan.bucket_of_step(0) != plan.bucket_of_step(1)  # the 2 steps train both sizes
    for name, (_, shared) in I2V_LAYOUTS.items():
        one = tmp_path / f"one_{name}"
        pt.main([*common, *shared, "--batch_size", "4", "--output_dir", str(one)])
        a, b = read_metrics(tmp_path / name / "metrics.jsonl"), read_metrics(one / "metrics.jsonl")
        assert [x["step"] for x in a] == [x["step"] for x in b] == [1, 2]
        assert a[0]["train/ratio_min"] == a[0]["train/ratio_max"] == 1.0
        for x, y in zip(a, b):
            assert x["reward/total_mean"] == pytest.approx(y["reward/total_mean"], rel=1e-5), name
            assert x["train/grad_norm"] == pytest.approx(y["train/grad_norm"], rel=1e-4), name
