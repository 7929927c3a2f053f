"""sage_grpo.generation: sample_videos (the sampling generate.py and training validation share) and write_sample."""

import json

import pytest
import torch

from sage_grpo.data import PromptRecord
from sage_grpo.generation import sample_stem, sample_videos, write_sample
from sage_grpo.seeding import prompt_noise_seed
from sage_grpo.video import read_prompt_file, read_video

SIZE = (5, 16, 32)  # frames, height, width


def _sample(pipe, cache, records, **kw):
    from sage_grpo.rollout import SamplerSettings, latent_shape

    settings = kw.pop("settings", SamplerSettings(sde_type="ode", eta=0.0, num_steps=2, shift=5.0, cfg_scale=1.0))
    shape = latent_shape(pipe.vae.config, *SIZE)
    return list(sample_videos(pipe, cache, records, settings=settings, shape=shape, base_seed=930, negative_prompt="",
                              **kw))


def test_sample_videos_yields_frames_per_record_independent_of_the_others(tiny_pipe, text_cache):
    recs = [PromptRecord("a cat", 0), PromptRecord("a dog", 1, seed=7)]
    out = _sample(tiny_pipe, text_cache, recs)
    assert [r for r, _ in out] == recs
    for _, frames in out:
        assert frames.shape == (5, 3, 16, 32) and frames.dtype == torch.float32 and frames.device.type == "cpu"
        assert 0 <= frames.min() and frames.max() <= 1
    # a video depends on its own prompt and seeds only: alone, or in another order, it is the same
    [(_, alone)] = _sample(tiny_pipe, text_cache, [recs[1]])
    assert torch.equal(alone, out[1][1])


def test_sample_videos_without_decode_runs_the_transformer_but_not_the_vae(tiny_pipe, text_cache, monkeypatch):
    """What the sequence-parallel peers of the writing rank do: every forward, no decode."""
    calls = {"transformer": 0, "vae": 0}
    hook = tiny_pipe.transformer.register_forward_pre_hook(
        lambda *a: calls.__setitem__("transformer", calls["transformer"] + 1))
    real = tiny_pipe.vae.decode
    monkeypatch.setattr(tiny_pipe.vae, "decode",
                        lambda *a, **k: (calls.__setitem__("vae", calls["vae"] + 1), real(*a, **k))[1])
    try:
        out = _sample(tiny_pipe, text_cache, [PromptRecord("a cat", 0)], decode=False)
        assert [f for _, f in out] == [None] and calls == {"transformer": 2, "vae": 0}
        _sample(tiny_pipe, text_cache, [PromptRecord("a cat", 0)])
        assert calls == {"transformer": 4, "vae": 1}
    finally:
        hook.remove()


def test_noise_seed_folds_in_the_prompt(tiny_pipe, text_cache, monkeypatch):
    """Equal seed columns no longer give different prompts the same noise: the rollout gets prompt_noise_seed."""
    import sage_grpo.rollout as rollout_mod

    seen = []
    real = rollout_mod.rollout

    def spy(*args, **kwargs):
        seen.append(int(kwargs["prompt_seeds"][0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(rollout_mod, "rollout", spy)
    recs = [PromptRecord("a cat", 0, seed=1), PromptRecord("a dog", 1, seed=1)]
    _sample(tiny_pipe, text_cache, recs)
    assert seen == [prompt_noise_seed("a cat", 1, 0), prompt_noise_seed("a dog", 1, 1)] and seen[0] != seen[1]


def test_sde_settings_and_training_mode_restored(tiny_pipe, text_cache):
    """An SDE sampler draws noise (another video than the ODE); the transformer's mode is given back."""
    from sage_grpo.rollout import SamplerSettings

    rec = [PromptRecord("a red ball", 0)]
    tiny_pipe.transformer.train()
    try:
        [(_, ode)] = _sample(tiny_pipe, text_cache, rec)
        assert tiny_pipe.transformer.training
        sde = SamplerSettings(sde_type="sage_grpo", eta=0.5, num_steps=2, shift=5.0, cfg_scale=1.0)
        [(_, noisy)] = _sample(tiny_pipe, text_cache, rec, settings=sde)
        assert not torch.equal(ode, noisy)
    finally:
        tiny_pipe.transformer.eval()


def test_write_sample_keeps_the_exact_prompt(tmp_path):
    prompt = "  a dog, running — 狗 \t"  # spaces, punctuation and non-ASCII survive
    frames = torch.rand(5, 3, 16, 32)
    path = write_sample(tmp_path / "s" / "0003_a_dog.mp4", frames, prompt=prompt, fps=12, meta={"seed": 1})
    assert path == tmp_path / "s" / "0003_a_dog.mp4"
    assert read_prompt_file(path) == prompt and (tmp_path / "s" / "0003_a_dog.txt").is_file()
    assert json.loads((tmp_path / "s" / "0003_a_dog_config.json").read_text()) == {"seed": 1}
    back, fps = read_video(path)
    assert back.shape == (5, 3, 16, 32) and fps == 12
    write_sample(tmp_path / "n.mp4", frames, prompt="x", fps=24)
    assert not (tmp_path / "n_config.json").exists()
    with pytest.raises(ValueError, match="mp4"):
        write_sample(tmp_path / "n.mkv", frames, prompt="x", fps=24)


def test_sample_stem():
    assert sample_stem(PromptRecord("a dog, running", 5)) == "0005_a_dog_running"
    assert sample_stem(PromptRecord("狗", 12)) == "0012_video"
