"""Text conditioning cache: one encode per distinct prompt (across ranks), valid tokens only, disk cache keyed by
prompt + encoder and safe for concurrent writers, glyph text."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY_FRAMES, TINY_H, TINY_W

from sage_grpo.models.text_cache import TextConditioning, TextEmbeddingCache

ROOT = Path(__file__).resolve().parents[1]


def _fields(c):
    return c.prompt_embeds, c.prompt_mask, c.byt5_embeds, c.byt5_mask


def test_each_prompt_encoded_once_and_equal_to_pipeline(tiny_pipe, text_cache):
    c = text_cache.get(["a cat", "a dog", "a cat", ""])
    assert text_cache.num_encoded == 3 and len(c) == 4
    assert torch.equal(c.prompt_embeds[0], c.prompt_embeds[2])
    pe, pm, be, bm = tiny_pipe.encode_prompt(["a dog"], device="cpu", dtype=torch.float32, batch_size=1)
    n = int(pm.sum())
    # the valid tokens are the pipeline's; the batch is padded to its longest prompt only, with zeros and mask 0
    assert torch.equal(c.prompt_embeds[1, :n], pe[0, :n]) and int(c.prompt_mask[1].sum()) == n
    assert c.prompt_embeds.shape[1] == int(c.prompt_mask.sum(1).max()) < pm.shape[1]
    assert not c.prompt_embeds[1, n:].any() and not c.prompt_mask[1, n:].any()
    assert int(bm.sum()) == 0 and not c.byt5_mask.any() and c.byt5_embeds.shape[1] == 1  # no glyph: one masked token
    text_cache.get(["a dog"])
    assert text_cache.num_encoded == 3


def test_memory_holds_valid_tokens_only(tiny_pipe, text_cache):
    prompts = ["a cat", 'a sign that says "OPEN" on a door']
    text_cache.precompute(prompts)
    width = tiny_pipe.transformer.config.text_embed_dim, tiny_pipe.transformer.config.text_embed_2_dim
    valid = [tiny_pipe.encode_prompt([p], device="cpu", dtype=torch.float32, batch_size=1) for p in prompts]
    want = sum((int(pm.sum()) * width[0] + int(bm.sum()) * width[1]) * 4 for _, pm, _, bm in valid)
    padded = sum(sum(t.nbytes for t in (pe, be)) for pe, _, be, _ in valid)
    assert text_cache.memory_bytes == want < padded / 2
    one = text_cache.lookup(prompts[1])
    assert one.prompt_mask.all() and one.byt5_mask.all() and one.prompt_embeds.shape[1] == int(valid[1][1].sum())


def test_transformer_output_equals_the_full_length_conditioning(tiny_pipe, text_cache):
    """Re-padding to the batch's longest valid length instead of the pipeline's 64 + 16 tokens changes nothing but
    float rounding (the refiner's masked attention and pooling sum over fewer zeros): exact in fp64, with diffusers'
    dense-mask processor and with the project's valid-token one."""
    import copy

    from sage_grpo.models.attention import use_diffusers_attention
    from sage_grpo.rollout import latent_shape

    prompts = ["a red ball rolls", 'a sign that says "hi" and more']
    full = TextConditioning(*tiny_pipe.encode_prompt(prompts, device="cpu", dtype=torch.float32, batch_size=2))
    short = text_cache.get(prompts)
    assert short.prompt_embeds.shape[1] < full.prompt_embeds.shape[1]
    assert short.byt5_embeds.shape[1] < full.byt5_embeds.shape[1]
    tr = copy.deepcopy(tiny_pipe.transformer).double()
    C, F, H, W = latent_shape(tiny_pipe.vae.config, TINY_FRAMES, TINY_H, TINY_W)
    x = torch.randn(2, 2 * C + 1, F, H, W, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def run(c, model):
        dt = next(model.parameters()).dtype
        c = c.to(dtype=dt)
        return model(hidden_states=x.to(dt), timestep=torch.tensor([500.0, 300.0], dtype=dt),
                     encoder_hidden_states=c.prompt_embeds, encoder_attention_mask=c.prompt_mask,
                     encoder_hidden_states_2=c.byt5_embeds, encoder_attention_mask_2=c.byt5_mask,
                     image_embeds=torch.zeros(2, tiny_pipe.vision_num_semantic_tokens, model.config.image_embed_dim,
                                              dtype=dt), return_dict=False)[0]

    with torch.no_grad():
        ref = run(full, tr)
        assert ref.abs().max() > 0.1 and (run(short, tr) - ref).abs().max() < 1e-12
        assert (run(short, tiny_pipe.transformer) - run(full, tiny_pipe.transformer)).abs().max() < 1e-5  # fp32
        use_diffusers_attention(tr)
        assert (run(short, tr) - run(full, tr)).abs().max() < 1e-12


def test_cat_pads_to_the_longest(text_cache):
    a, b = text_cache.get(["a cat"]), text_cache.get(['a much longer prompt that says "hello"'])
    c = TextConditioning.cat([a, b])
    assert c.prompt_embeds.shape[1] == b.prompt_embeds.shape[1] > a.prompt_embeds.shape[1]
    assert c.byt5_embeds.shape[1] == b.byt5_embeds.shape[1] > 1
    assert torch.equal(c.index([1]).prompt_embeds, b.prompt_embeds)
    n = a.prompt_embeds.shape[1]
    assert torch.equal(c.prompt_embeds[0, :n], a.prompt_embeds[0]) and not c.prompt_embeds[0, n:].any()
    assert torch.equal(c.prompt_mask.sum(1), torch.cat([a.prompt_mask.sum(1), b.prompt_mask.sum(1)]))


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


# ---- the disk cache under concurrent writers


def _bare_cache(cache_dir):
    """A cache without a pipeline (only the disk layer is exercised): the identity is set by hand."""
    c = TextEmbeddingCache(None, "cpu", torch.float32, cache_dir)
    c._identity = "test"
    return c


def test_two_writers_of_one_prompt_interleaved(tmp_path, monkeypatch):
    """Writer A has written its temporary file but not renamed it when writer B writes and renames the same prompt.
    With one shared "<key>.tmp" name B renamed A's file away and A's rename raised FileNotFoundError."""
    import sage_grpo.models.text_cache as tc

    a, b = _bare_cache(tmp_path), _bare_cache(tmp_path)
    entry = tc._Entry(torch.randn(3, 8), torch.zeros(0, 4))
    real_save, written = tc.save_file, []

    def save_then_other_writer(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        written.append(Path(filename).name)
        if len(written) == 1:
            b._save_disk("p", entry)

    monkeypatch.setattr(tc, "save_file", save_then_other_writer)
    a._save_disk("p", entry)
    assert len(written) == 2 and written[0] != written[1]
    got = a._read(a._path("p"), "p")
    assert torch.equal(got.mllm, entry.mllm) and got.byt5.shape == (0, 4)
    assert [f.name for f in tmp_path.iterdir()] == [a._path("p").name]  # no temporary file left behind


def test_a_complete_file_is_never_rewritten(tmp_path):
    import sage_grpo.models.text_cache as tc

    c = _bare_cache(tmp_path)
    first = tc._Entry(torch.randn(3, 8), torch.randn(2, 4))
    c._save_disk("p", first)
    before = c._path("p").stat()
    c._save_disk("p", tc._Entry(torch.randn(3, 8), torch.randn(2, 4)))  # e.g. a rank that encoded it too
    after = c._path("p").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert torch.equal(c._read(c._path("p"), "p").mllm, first.mllm)


def test_a_partial_file_is_a_miss_and_is_replaced(tiny_pipe, tmp_path):
    first = TextEmbeddingCache(tiny_pipe, "cpu", torch.float32, tmp_path).get(["a red ball rolls"])
    [path] = tmp_path.glob("*.safetensors")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a writer that died mid-file (old code)
    c = TextEmbeddingCache(tiny_pipe, "cpu", torch.float32, tmp_path)
    with pytest.warns(UserWarning, match="unreadable"):
        again = c.get(["a red ball rolls"])
    assert c.num_encoded == 1 and all(torch.equal(x, y) for x, y in zip(_fields(first), _fields(again)))
    fresh = TextEmbeddingCache(tiny_pipe, "cpu", torch.float32, tmp_path)
    fresh.get(["a red ball rolls"])
    assert fresh.num_encoded == 0  # the file was replaced by a complete one


def test_padded_files_of_the_previous_format_still_load(tiny_pipe, tmp_path):
    from safetensors.torch import save_file

    c = TextEmbeddingCache(tiny_pipe, "cpu", torch.float32, tmp_path)
    pe, pm, be, bm = tiny_pipe.encode_prompt(["a cat"], device="cpu", dtype=torch.float32, batch_size=1)
    save_file({"prompt_embeds": pe, "prompt_mask": pm, "byt5_embeds": be, "byt5_mask": bm}, c._path("a cat"),
              metadata={"prompt": "a cat", "identity": c.identity})
    got = c.get(["a cat"])
    n = int(pm.sum())
    assert c.num_encoded == 0 and got.prompt_embeds.shape[1] == n and torch.equal(got.prompt_embeds[0], pe[0, :n])


def test_an_unwritable_cache_dir_is_one_clear_error(tiny_pipe, tmp_path):
    from sage_grpo.errors import SageGRPOError

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SageGRPOError, match="cannot write the text-embedding cache --text_embedding_cache_dir"):
        TextEmbeddingCache(tiny_pipe, "cpu", torch.float32, blocker / "cache").get(["a cat"])


@pytest.mark.dist
def test_processes_hammering_one_directory(tmp_path):
    """4 processes write and read the same prompts at once, 60 rounds: no exception, every read is complete."""
    worker = ROOT / "tests/dist_workers/text_cache_disk_worker.py"
    start = time.time() + 8  # every process has imported torch by then
    procs = [subprocess.Popen([sys.executable, str(worker), str(tmp_path), str(start), "60"], cwd=ROOT,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(e[-1500:] for e in errors)
    assert len(list(tmp_path.glob("*.safetensors"))) == 60 * 4 and not list(tmp_path.glob("*.tmp"))


@pytest.mark.dist
def test_shared_precompute_on_two_ranks(tiny_diffusers_dir, tmp_path):
    """Each distinct prompt is encoded by one rank (7 prompts: 4 + 3), shared by all-gather (memory only) or through
    the cache directory (nothing held in memory); a second run encodes nothing; different prompt lists and a
    failure on one rank end with one error on every rank instead of a hang."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(ROOT / "tests/dist_workers/text_cache_worker.py"), str(tmp_path), str(tiny_diffusers_dir),
                        str(tmp_path / "cache")], capture_output=True, text=True, cwd=ROOT, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert [x["mem_encoded"] for x in ranks] == [4, 3] and [x["disk_encoded"] for x in ranks] == [4, 3]
    for x in ranks:
        assert x["mem_len"] == 7 and x["mem_equal_to_pipeline"] and x["mem_encoded_after_get"] == x["mem_encoded"]
        assert x["disk_memory_bytes"] == 0 and x["disk_len"] == 7 and x["disk_equal_to_memory"]
        assert x["disk_encoded_after_get"] == x["disk_encoded"] and x["again_encoded"] == 0
        assert x["files"] == 7 and x["tmp_files"] == 0
        assert "different prompt lists" in x["mismatch_error"]
        assert "failed on 1 rank(s); rank 1: cannot encode" in x["failure_error"]


def test_released_encoders_are_freed_and_come_back_for_a_prompt_not_cached(tiny_diffusers_dir, tiny_pipe):
    """post_train's order: conditioning parts with a meta stand-in for the transformer, every prompt encoded, the
    encoders freed (not moved: nothing holds them), a later uncached prompt encoded by reloaded encoders."""
    import gc
    import weakref

    from sage_grpo.models.loading import load_pipeline, read_text_encoders

    pipe = load_pipeline(model_path=str(tiny_diffusers_dir), dtype="fp32", load_text_encoders=False,
                         load_transformer=False)
    assert next(pipe.transformer.parameters()).is_meta  # config only, no memory
    assert pipe.text_encoder is None  # loaded by the cache, and only for a prompt it does not hold
    reloads = []

    def reload():
        reloads.append(1)
        return read_text_encoders(pipe.sage_grpo_location, torch.float32)

    cache = TextEmbeddingCache(pipe, "cpu", torch.float32, loader=reload)
    cache.precompute(["x", "y"])
    assert reloads == [1]  # once for both prompts
    encoders = [weakref.ref(pipe.text_encoder), weakref.ref(pipe.text_encoder_2)]
    reloads.clear()
    cache.release_encoders()
    gc.collect()
    assert pipe.text_encoder is None and pipe.text_encoder_2 is None
    assert all(ref() is None for ref in encoders)
    cache.get(["x"])
    assert not reloads  # cached: the encoders stay away
    got = cache.get(["z"])
    reference = TextEmbeddingCache(tiny_pipe, "cpu", torch.float32).get(["z"])
    assert reloads == [1] and pipe.text_encoder is None  # released again after the prompt
    assert all(torch.equal(a, b) for a, b in zip(_fields(got), _fields(reference)))
