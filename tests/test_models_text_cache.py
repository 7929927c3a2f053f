"""Text conditioning cache: one encode per distinct prompt, disk cache keyed by prompt + encoder, glyph text."""

import torch

from sage_grpo.models.text_cache import TextEmbeddingCache


def test_each_prompt_encoded_once_and_equal_to_pipeline(tiny_pipe, text_cache):
    c = text_cache.get(["a cat", "a dog", "a cat", ""])
    assert text_cache.num_encoded == 3 and len(c) == 4
    assert torch.equal(c.prompt_embeds[0], c.prompt_embeds[2])
    ref = tiny_pipe.encode_prompt(["a dog"], device="cpu", dtype=torch.float32, batch_size=1)
    for got, want in zip((c.prompt_embeds[1:2], c.prompt_mask[1:2], c.byt5_embeds[1:2], c.byt5_mask[1:2]), ref):
        assert torch.equal(got, want)
    text_cache.get(["a dog"])
    assert text_cache.num_encoded == 3


def test_glyph_text_uses_byt5(text_cache):
    c = text_cache.get(['a sign that says "OPEN"', "a sign"])
    assert c.byt5_mask[0].sum() > 0 and c.byt5_embeds[0].abs().sum() > 0
    assert c.byt5_mask[1].sum() == 0 and c.byt5_embeds[1].abs().sum() == 0


def test_disk_cache_hits_and_is_keyed_by_encoder(tiny_pipe, tiny_diffusers_dir, tmp_path):
    import shutil

    from sage_grpo.models.loading import load_pipeline
    from sage_grpo.models.tiny_checkpoint import write_tiny_checkpoint

    cache = tmp_path / "cache"
    a = TextEmbeddingCache(tiny_pipe, "cpu", torch.float32, cache)
    first = a.get(["a red ball rolls"])
    assert a.num_encoded == 1 and len(list(cache.glob("*.safetensors"))) == 1
    b = TextEmbeddingCache(tiny_pipe, "cpu", torch.float32, cache)
    again = b.get(["a red ball rolls"])
    assert b.num_encoded == 0 and torch.equal(first.prompt_embeds, again.prompt_embeds)
    # The same files elsewhere, loaded without text encoders: same identity, served from disk.
    moved = shutil.copytree(tiny_diffusers_dir, tmp_path / "moved")
    no_enc = load_pipeline(model_path=str(moved), dtype="fp32", load_text_encoders=False)
    c = TextEmbeddingCache(no_enc, "cpu", torch.float32, cache)
    assert c.identity == a.identity
    assert torch.equal(c.get(["a red ball rolls"]).prompt_embeds, first.prompt_embeds) and c.num_encoded == 0
    # Other encoder weights on disk -> another identity -> no stale hit.
    other = load_pipeline(model_path=str(write_tiny_checkpoint(tmp_path / "other", "diffusers", seed=1)), dtype="fp32")
    d = TextEmbeddingCache(other, "cpu", torch.float32, cache)
    assert d.identity != a.identity
    d.get(["a red ball rolls"])
    assert d.num_encoded == 1


def test_offload_still_encodes_new_prompts(text_cache, tiny_pipe):
    text_cache.precompute(["x", "y"])
    text_cache.offload_encoders()
    assert next(tiny_pipe.text_encoder.parameters()).device.type == "cpu"
    c = text_cache.get(["z"], dtype=torch.bfloat16)
    assert c.prompt_embeds.dtype == torch.bfloat16 and text_cache.num_encoded == 3


def test_prompts_over_the_encoder_limits_are_truncated_with_a_warning(tiny_pipe, text_cache):
    import warnings

    from sage_grpo.models.text_cache import truncated_lengths

    limit = tiny_pipe.tokenizer_max_length
    short, long = "a cat", "a cat " * (2 * limit)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text_cache.get([short])
        assert not caught
        got = text_cache.get([long, long + "and a red dog running"])
    assert len(caught) == 2 and "limit is" in str(caught[0].message) and "cut off" in str(caught[0].message)
    # what the warning claims is what the encoder did: every token slot is used and the extra words change nothing
    assert int(got.prompt_mask[0].sum()) == limit
    assert torch.equal(got.prompt_embeds[0], got.prompt_embeds[1])
    assert int(text_cache.get([short]).prompt_mask.sum()) < limit
    # the glyph encoder's own limit (bytes of the quoted text)
    glyph = 'a sign that says "' + "x" * (3 * tiny_pipe.tokenizer_2_max_length) + '"'
    assert [name for name, _, _ in truncated_lengths(tiny_pipe, glyph)][-1] == "glyph (ByT5) encoder"
    assert truncated_lengths(tiny_pipe, 'a sign that says "hi"') == []
