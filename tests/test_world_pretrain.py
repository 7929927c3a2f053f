"""The tiny world model's pretraining (sage_grpo.world.pretrain): its tokenizer, the batched VAE attention mask,
the stages' determinism, and that what it writes loads through the real loader."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.world import COLORS, make_caption, world_captions
from sage_grpo.world.pretrain import (
    LOCAL_QK,
    WORLD_I2V_MODEL_DIR,
    WORLD_MODEL_DIR,
    PretrainSettings,
    batched_vae_attention,
    build_world_components,
    encode_first_frames,
    i2v_model_dir,
    object_cells,
    pretrain,
    reusable_vae,
    train_transformer,
    world_tokenizer,
    world_words,
)
from sage_grpo.world.sampler import single_object_attributes


def test_world_words_cover_every_caption():
    words = set(world_words())
    captions = [make_caption(a) for split in ("train", "heldout") for a in single_object_attributes(split)]
    assert {w for c in captions for w in c.split()} | {"and", "move"} == words
    two = world_captions(300, seed=3, two_object_prob=1.0)
    assert {w for c in two for w in c.split()} - words == {"bounce"}  # a token through "bounces", see below


def test_world_tokenizer_makes_each_word_one_token_and_round_trips():
    tok = world_tokenizer()
    bounce = "a small red circle and a large blue square bounce on a green background"
    for caption in [bounce, *world_captions(50, seed=1, two_object_prob=0.5)]:
        ids = tok(caption, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(caption.split())  # one token per word (the first has no leading space)
        assert tok.decode(ids) == caption
    # words outside the world still encode, byte by byte, and decode back
    other = "a purple hexagon spins"
    ids = tok(other, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == other and len(ids) > len(other.split())


def test_batched_vae_attention_mask_equals_diffusers_and_restores_it():
    from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as vae_module

    block = vae_module.HunyuanVideo15AttnBlock
    original = block.prepare_causal_attention_mask
    ref = original(3, 4, torch.float32, "cpu")  # diffusers' loop, [S, S]
    with batched_vae_attention():
        ours = block.prepare_causal_attention_mask(3, 4, torch.float32, "cpu")
        batched = block.prepare_causal_attention_mask(3, 4, torch.float32, "cpu", batch_size=2)
    assert torch.equal(ours, ref)
    assert batched.shape == (2, 1, 12, 12) and torch.equal(batched[1, 0], ref)
    assert block.prepare_causal_attention_mask is original


def test_batched_vae_attention_decodes_a_batch_like_one_at_a_time():
    """The point of the patch: a batch of 2 through the VAE equals each sample alone (diffusers' mask fails)."""
    from sage_grpo.world.pretrain import build_world_components

    vae = build_world_components(0)["vae"]
    z = torch.randn(2, vae.config.latent_channels, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), batched_vae_attention():
        both = vae.decode(z).sample
        alone = torch.cat([vae.decode(z[i : i + 1]).sample for i in range(2)])
    torch.testing.assert_close(both, alone, rtol=1e-5, atol=1e-5)


TINY = PretrainSettings(num_clips=6, vae_steps=2, vae_batch=2, transformer_steps=2, transformer_batch=2,
                        warmup_steps=1, threads=1)


@pytest.mark.slow
def test_pretrain_is_deterministic_and_loads_through_the_real_loader(tmp_path):
    from safetensors.torch import load_file

    from sage_grpo.models.loading import load_pipeline

    logs: list[str] = []
    info = pretrain(TINY, tmp_path / "a", log=logs.append)
    pretrain(TINY, tmp_path / "b", log=lambda _: None)
    reused = pretrain(TINY, tmp_path / "c", log=lambda _: None, reuse_vae=tmp_path / "a")
    for part in ("transformer", "vae"):
        a = load_file(tmp_path / "a" / part / "diffusion_pytorch_model.safetensors")
        for other in ("b", "c"):  # a second run, and one that takes the first run's VAE, give the same weights
            b = load_file(tmp_path / other / part / "diffusion_pytorch_model.safetensors")
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (part, other)
    assert reused["stages"]["vae"]["reused_from"] == str(tmp_path / "a") and reused["vae"] == info["vae"]
    with pytest.raises(SageGRPOError, match="other settings.*vae_steps"):
        reusable_vae(replace(TINY, vae_steps=3), tmp_path / "a")
    with pytest.raises(SageGRPOError, match="no pretrain_info.json"):
        reusable_vae(TINY, tmp_path)
    assert any("transformer step 2/2" in line for line in logs)
    saved = json.loads((tmp_path / "a" / "pretrain_info.json").read_text())
    assert saved["settings"] == TINY.to_dict() and set(saved["stages"]) == {"render", "vae", "encode", "transformer"}
    assert info["scaling_factor"] > 0
    i2v = load_pipeline(model_path=str(i2v_model_dir(tmp_path / "a")), dtype="fp32")  # TINY.i2v_prob > 0
    assert i2v.sage_grpo_task == "i2v" and type(i2v.image_encoder).__name__ == "SiglipVisionModel"
    for part in ("transformer", "vae"):  # the same files as the text-to-video checkpoint: git stores them once
        name = f"{part}/diffusion_pytorch_model.safetensors"
        assert (tmp_path / "a" / name).read_bytes() == (i2v_model_dir(tmp_path / "a") / name).read_bytes()
    pipe = load_pipeline(model_path=str(tmp_path / "a"), dtype="fp32")
    assert pipe.sage_grpo_task == "t2v" and pipe.transformer.config.num_layers == 4
    assert pipe.vae.config.latent_channels == TINY.latent_channels == 16
    assert pipe.vae.config.scaling_factor == pytest.approx(info["scaling_factor"])
    ids = pipe.tokenizer("a red circle", add_special_tokens=False)["input_ids"]
    assert len(ids) == 3  # the saved tokenizer keeps the word merges
    # a rebuild writes the committed checkpoints' sampling defaults (the guider at WORLD_GUIDANCE_SCALE, shift 5)
    root = Path(__file__).resolve().parents[1]
    for out, committed in ((tmp_path / "a", WORLD_MODEL_DIR), (i2v_model_dir(tmp_path / "a"), WORLD_I2V_MODEL_DIR)):
        for name in ("guider/guider_config.json", "scheduler/scheduler_config.json"):
            assert json.loads((out / name).read_text()) == json.loads((root / committed / name).read_text()), name


@pytest.mark.slow
def test_pretrain_killed_in_the_transformer_stage_continues_to_the_same_weights(tmp_path):
    """A pretraining killed (SIGKILL) once its transformer stage has saved a step of 10, then scripts/pretrain_tiny.py
    with the same settings: it takes the finished VAE stage, continues from that step, and writes the weights of an
    uninterrupted run (same settings and threads), bitwise; the state folder is gone after.
    Seen failing when the stage's generator state is not restored."""
    import multiprocessing
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from safetensors.torch import load_file

    root = Path(__file__).resolve().parents[1]
    s = replace(TINY, transformer_steps=10)
    flags = [x for k, v in s.to_dict().items() for x in (f"--{k}", str(v))] + ["--checkpoint_every", "2"]

    def run(out):
        return subprocess.Popen([sys.executable, str(root / "scripts/pretrain_tiny.py"), "--out", str(out), *flags],
                                cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    # the run to kill: a fork of this process (torch already imported) running what the script runs
    proc = multiprocessing.get_context("fork").Process(
        target=pretrain, args=(s, killed), kwargs={"log": lambda _: None, "checkpoint_every": 2})
    proc.start()
    state = killed / "pretrain_state" / "transformer.pt"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.is_alive():
        if state.is_file():  # written atomically: a whole saved state
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.join(timeout=60)
    assert proc.exitcode == -signal.SIGKILL, "the run ended before its transformer stage saved a step"
    again = run(killed)  # the script, with the same flags
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0, out[-2000:]
    assert "vae: reused from" in out and "transformer: continuing from step" in out
    pretrain(s, straight, log=lambda _: None, checkpoint_every=2)
    for part in ("transformer", "vae"):
        a = load_file(straight / part / "diffusion_pytorch_model.safetensors")
        b = load_file(killed / part / "diffusion_pytorch_model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    assert not (killed / "pretrain_state").exists() and not (straight / "pretrain_state").exists()


def test_object_cells_mark_the_latent_cells_whose_frames_show_an_object():
    """Against a loop over the causal VAE's cells: latent frame 0 = frame 0, latent frame k = frames 4k-3 .. 4k,
    4 x 4 pixels a cell; a cell is marked iff one of its pixels differs from the background colour."""
    from sage_grpo.world.pretrain import render_clips

    videos, _ = render_clips(replace(TINY, num_clips=3))  # uint8 [3, 9, 3, 32, 32]
    vae = build_world_components(0)["vae"]
    got = object_cells(videos, vae.config)
    assert got.shape == (3, 1, 3, 8, 8)
    for n in range(3):
        bg = videos[n, 0].flatten(1).median(dim=1).values  # the background covers most of the frame
        off = (videos[n].int() - bg[None, :, None, None].int()).abs().amax(dim=1) > 0.2 * 127.5  # [9, 32, 32]
        for f, frames in enumerate([[0], [1, 2, 3, 4], [5, 6, 7, 8]]):
            for y in range(8):
                for x in range(8):
                    want = bool(off[frames, 4 * y : 4 * y + 4, 4 * x : 4 * x + 4].any())
                    assert bool(got[n, 0, f, y, x]) == want, (n, f, y, x)
    assert 0.02 < float(got.mean()) < 0.6  # objects, not the whole frame


def test_object_weight_reaches_the_transformer_loss():
    """No cells marked trains exactly like no weighting; cells marked change the weights (seen failing when the
    weight is built but the loss stays the plain MSE)."""
    from diffusers import HunyuanVideo15Pipeline

    from sage_grpo.models.loading import apply_text_lengths

    s = replace(TINY, num_clips=4, transformer_steps=2)
    latents = torch.randn(4, 16, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    captions = [make_caption(a) for a in single_object_attributes("train")[:4]]
    marked = torch.zeros(4, 1, 3, 8, 8)
    marked[..., :4, :] = 1.0

    def train(objects):
        comps = build_world_components(0)
        lengths = comps.pop("text_lengths")
        pipe = HunyuanVideo15Pipeline(**comps)
        apply_text_lengths(pipe, lengths)
        ema, _ = train_transformer(pipe, latents, captions, s, log=lambda _: None, objects=objects)
        return torch.cat([p.flatten() for p in ema.parameters()])

    plain = train(None)
    assert torch.equal(train(torch.zeros(4, 1, 3, 8, 8)), plain)
    assert not torch.allclose(train(marked), plain)


@pytest.mark.slow
def test_transformer_training_mixes_first_frame_conditioned_batches(monkeypatch):
    """With first-frame images, a share i2v_prob of the batches reaches the forward with the image conditioning of
    exactly the batch's clips (condition latents and SigLIP embeds, also for a caption dropped for CFG); the others
    with none. Seen failing with the batch's images indexed by position instead of by the sampled clips."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    import sage_grpo.rollout as rollout
    from sage_grpo.models.loading import apply_text_lengths
    from sage_grpo.world.pretrain import render_clips

    s = replace(TINY, num_clips=8, transformer_steps=40, transformer_batch=3, caption_dropout=0.5, i2v_prob=0.3)
    comps = build_world_components(0, i2v=True)
    lengths = comps.pop("text_lengths")
    pipe = HunyuanVideo15ImageToVideoPipeline(**comps)
    apply_text_lengths(pipe, lengths)
    videos, captions = render_clips(s)
    images = encode_first_frames(pipe, videos)  # [8, ...]
    assert images.latents.shape == (8, 16, 1, 8, 8) and images.embeds.shape == (8, 4, 16)
    assert len({tuple(e.flatten().tolist()) for e in images.embeds}) == 8  # each clip's own first frame
    latents = torch.randn(8, 16, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    batches, seen, real_randint, real = [], [], torch.randint, rollout.predict_velocity

    def randint(high, size, generator=None):  # the clips each step samples, in order
        idx = real_randint(high, size, generator=generator)
        if tuple(size) == (s.transformer_batch,):
            batches.append(idx.tolist())
        return idx

    def spy(transformer, xt, sigma, cond, uncond, settings, image_tokens, image=None):
        clips = batches[len(seen)]
        seen.append(image)
        if image is not None:  # which clips' first frames came: each row matched against the encoded ones
            rows = [int((images.latents == lat).flatten(1).all(1).nonzero()) for lat in image.latents]
            assert rows == clips and torch.equal(image.embeds, images.embeds[clips]), (rows, clips)
        return real(transformer, xt, sigma, cond, uncond, settings, image_tokens, image=image)

    monkeypatch.setattr(rollout, "predict_velocity", spy)
    monkeypatch.setattr(torch, "randint", randint)
    train_transformer(pipe, latents, captions, s, log=lambda _: None, images=images)
    i2v = sum(x is not None for x in seen)
    assert len(seen) == 40 and 4 <= i2v <= 20, i2v  # Binomial(40, 0.3): mean 12
    assert all(len(x) == 3 for x in seen if x is not None)  # every sample of an I2V batch has its image


def test_world_text_encoder_is_unit_scale_and_the_rest_keeps_diffusers_init():
    from sage_grpo.world.pretrain import build_world_components

    comps = build_world_components(0)
    emb = comps["text_encoder"].get_input_embeddings().weight
    assert 0.95 < float(emb.std()) < 1.05
    attn = comps["text_encoder"].layers[0].self_attn
    assert abs(float(attn.v_proj.weight.std()) * attn.v_proj.weight.shape[1] ** 0.5 - 1.0) < 0.1
    for proj in (attn.q_proj, attn.k_proj):  # constant queries and keys: attention by rotary distance only
        assert not proj.weight.any() and torch.all(proj.bias == LOCAL_QK)
    # the transformer is not perturbed: diffusers' zero-initialised layers stay zero for training
    assert any(float(p.abs().max()) == 0.0 for p in comps["transformer"].parameters())


def test_off_background_marks_the_object_pixels():
    from sage_grpo.world import render_caption
    from sage_grpo.world.pretrain import _off_background, _to_vae

    clip = (render_caption("a large red square moves right on a blue background", seed=0) * 255).round()
    clip = clip.to(torch.uint8)[None]  # [1, F, 3, H, W]
    mask = _off_background(clip, _to_vae(clip))  # [1, 1, F, H, W]
    blue = (torch.tensor(COLORS["blue"]) * 255).round().view(1, 3, 1, 1) / 255  # as stored in the uint8 clip
    off = (clip[0] / 255 - blue).abs().amax(dim=1) > 0.1  # [F, H, W] 0.1 in [0, 1] = the 0.2 in the VAE's [-1, 1]
    assert mask.shape == (1, 1, *off.shape) and torch.equal(mask[0, 0].bool(), off)
    assert 0.1 < float(off.float().mean()) < 0.3  # a large square: 2 x 0.2 of the side, squared, plus its edges


def test_world_text_encoder_carries_word_order():
    """The point of the local attention: the same colour word as the object's and as the background's colour gives
    different features, and so does the word after it (at transformers' random init both differ by ~1%)."""
    from diffusers import HunyuanVideo15Pipeline

    from sage_grpo.models.loading import apply_text_lengths
    from sage_grpo.models.text_cache import TextEmbeddingCache
    from sage_grpo.world.pretrain import build_world_components

    comps = build_world_components(0)
    lengths = comps.pop("text_lengths")
    pipe = HunyuanVideo15Pipeline(**comps)
    apply_text_lengths(pipe, lengths)
    e = TextEmbeddingCache(pipe, "cpu", torch.float32).get([
        "a small red circle moves left on a blue background", "a small blue circle moves left on a red background",
    ]).prompt_embeds  # [2, L, D]; tokens: a, small, red/blue (2), circle (3), ..., blue/red (8), background (9)

    def rel(x, y):
        return float((x - y).norm() / x.norm())

    assert rel(e[0, 2], e[1, 8]) > 0.2  # "red" as the object's colour vs as the background's
    assert rel(e[0, 9], e[1, 9]) > 0.15  # "background" after "blue" vs after "red"
