"""VideoAlign: tiny checkpoint loading (forms, modes, layouts, steps), scoring semantics, errors, mp4 equivalence."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import TINY_MIN_PIXELS, smooth_videos

from sage_grpo.errors import SageGRPOError
from sage_grpo.rewards.videoalign import (
    CHAT_PREFIX,
    CHAT_SUFFIX,
    VideoAlignReward,
    build_prompt,
    chat_text,
)
from sage_grpo.rewards.videoalign_ckpt import (
    DEFAULT_NORM,
    SPECIAL_TOKENS,
    find_checkpoint,
    lora_scale,
    merge_lora,
    remap_keys,
    remap_v1,
    remap_v2,
    remap_v3,
)
from sage_grpo.video import read_video, write_video

PROMPTS = ["a red fox jumps over a log", "ocean waves at dusk, slow camera pan", ""]


def make(dirs, layout="old", **kw) -> VideoAlignReward:
    """A float32 tiny reward on CPU."""
    kw.setdefault("dtype", torch.float32)
    kw.setdefault("min_pixels", TINY_MIN_PIXELS)
    return VideoAlignReward(dirs[layout], dirs["base"], **kw)


@pytest.fixture(scope="module")
def reward(tiny_dirs):  # noqa: F811
    """The default-loaded tiny reward (old layout, v3, newest step, auto form = full)."""
    return make(tiny_dirs)


@pytest.fixture(scope="module")
def videos():
    """Three smooth 9-frame 32x48 videos."""
    return smooth_videos(3, 9, 32, 48)


# ---------------------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------------------


def test_all_forms_modes_layouts_give_the_same_model(tiny_dirs, reward, videos):  # noqa: F811
    """Full and LoRA forms, modes v1/v2/v3, 4.4x and current layouts: identical merged weights and scores."""
    ref_state = reward.net.state_dict()
    ref = reward(videos, PROMPTS)["Overall"]
    assert torch.isfinite(ref).all()
    for layout in ("old", "new"):
        for form in ("full", "lora"):
            for mode in ("v1", "v2", "v3"):
                r = make(tiny_dirs, layout, weights_form=form, checkpoint_mode=mode)
                assert r.files.form == form and r.files.step == 8
                st = r.net.state_dict()
                for k, v in ref_state.items():
                    # LoRA form merges into the base file's tensors, full form into model.pth's copies of them:
                    # same numbers, same float32 arithmetic -> bitwise equal
                    assert torch.equal(st[k], v), (layout, form, mode, k)
                if mode == "v1":  # equal weights imply equal scores; score a few combinations end to end
                    assert torch.equal(r(videos, PROMPTS)["Overall"], ref), (layout, form, mode)


def test_newest_step_by_default_and_explicit_step(tiny_dirs, reward, videos):  # noqa: F811
    """checkpoint-8 is newest; step 2 holds other weights; an absent step lists the available ones."""
    assert reward.files.step == 8
    older = make(tiny_dirs, checkpoint_step=2)
    assert older.files.step == 2
    assert not torch.allclose(older(videos, PROMPTS)["Overall"], reward(videos, PROMPTS)["Overall"])
    with pytest.raises(SageGRPOError, match=r"available steps: \[2, 8\]"):
        make(tiny_dirs, checkpoint_step=5)


def test_remap_functions_against_hand_written_keys():
    """The three modes map the published 4.4x keys to the current layout; v2 alone maps current -> 4.4x."""
    old = {
        "base_model.model.visual.blocks.0.attn.qkv.weight": "base_model.model.model.visual.blocks.0.attn.qkv.weight",
        "base_model.model.model.layers.1.mlp.up_proj.lora_A.default.weight":
            "base_model.model.model.language_model.layers.1.mlp.up_proj.lora_A.default.weight",
        "base_model.model.model.embed_tokens.weight": "base_model.model.model.language_model.embed_tokens.weight",
        "base_model.model.model.norm.weight": "base_model.model.model.language_model.norm.weight",
        "base_model.model.rm_head.weight": "base_model.model.rm_head.weight",
        "base_model.model.lm_head.weight": "base_model.model.lm_head.weight",
    }  # fmt: skip
    for src, dst in old.items():
        assert remap_v1(src) == dst and remap_v3(src) == dst
        assert remap_v1(dst) == dst and remap_v3(dst) == dst  # current keys pass through
        assert remap_v2(dst) == src
    assert (
        remap_v3("base_model.model.vision_tower.merger.ln_q.weight")
        == "base_model.model.model.visual.merger.ln_q.weight"
    )
    # "normalizer" must not be mistaken for the final "norm" of the old layout
    assert remap_v1("base_model.model.model.normalizer.x") == "base_model.model.model.normalizer.x"
    with pytest.raises(SageGRPOError, match="valid: v1, v2, v3"):
        remap_keys({}, "v4")


def test_lora_merge_matches_peft(tiny_dirs):  # noqa: F811
    """Our exact merge W + alpha/r * B @ A equals peft's merge_and_unload on the same tiny model and adapter."""
    peft = pytest.importorskip("peft")  # installed in the dev venv; the runtime merge does not need it
    from transformers import Qwen2VLConfig, Qwen2VLModel

    torch.manual_seed(0)
    cfg = Qwen2VLConfig.from_pretrained(str(tiny_dirs["base"]))
    model = Qwen2VLModel._from_config(cfg)
    targets = ["q_proj", "v_proj", "down_proj"]
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    pm = peft.get_peft_model(model, lcfg)
    state = {k: v.clone() for k, v in pm.state_dict().items()}  # base_model.model.<...>.base_layer / lora_A.default
    merged_ref = pm.merge_and_unload().state_dict()
    ours = merge_lora(state, lora_scale({"lora_r": 4, "lora_alpha": 8}))
    ours = {k[len("base_model.model.") :]: v for k, v in ours.items()}
    assert set(ours) == set(merged_ref)
    for k, v in merged_ref.items():
        torch.testing.assert_close(ours[k], v, rtol=0, atol=1e-6, msg=k)
    assert lora_scale({"lora_r": 64, "lora_alpha": 128}) == 2.0
    assert lora_scale({"lora_r": 64, "lora_alpha": 128, "use_rslora": True}) == 16.0


# ---------------------------------------------------------------------------------------------------------------
# scoring semantics
# ---------------------------------------------------------------------------------------------------------------


def test_scores_finite_deterministic_and_normalised(tiny_dirs, reward, videos):  # noqa: F811
    """Finite, repeatable (same instance and a fresh one), z-normalised with the paper's stats, Overall = sum."""
    a, b = reward(videos, PROMPTS), reward(videos, PROMPTS)
    c = make(tiny_dirs)(videos, PROMPTS)
    for k in reward.components:
        assert a[k].shape == (3,) and a[k].dtype == torch.float32 and torch.isfinite(a[k]).all()
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], c[k])
    for k, (m, s) in DEFAULT_NORM.items():
        torch.testing.assert_close(a[k], (a[f"{k}_raw"] - m) / s)
    assert DEFAULT_NORM == {"VQ": (3.6757, 2.2476), "MQ": (1.1646, 1.3811), "TA": (2.8105, 2.5121)}
    torch.testing.assert_close(a["Overall"], a["VQ"] + a["MQ"] + a["TA"])
    # the three heads read different tokens and the videos differ: scores are not degenerate
    assert a["VQ_raw"].std() > 0 and not torch.allclose(a["VQ_raw"], a["TA_raw"])


def test_batched_equals_one_at_a_time_and_chunked(tiny_dirs, reward, videos):  # noqa: F811
    """Right padding and batching do not change a video's score; reward_batch_size chunks give the same."""
    full = reward(videos, PROMPTS)["Overall"]
    single = torch.cat([reward(videos[i : i + 1], PROMPTS[i : i + 1])["Overall"] for i in range(3)])
    torch.testing.assert_close(full, single, rtol=0, atol=2e-5)
    chunked = make(tiny_dirs, batch_size=2)(videos, PROMPTS)["Overall"]
    torch.testing.assert_close(full, chunked, rtol=0, atol=2e-5)


def test_one_d_positions_match_model_default_and_differ_from_mrope(reward, videos):
    """Our explicit 1-D positions equal the text model's own running index; M-RoPE video positions differ."""
    from sage_grpo.rewards.video_preprocess import preprocess_videos

    v = videos[:1]
    pixels, grid = preprocess_videos(v, min_pixels=TINY_MIN_PIXELS)
    ids, mask = reward.build_input_ids(PROMPTS[:1], (grid.prod(-1) // 4).tolist())
    lm, net = reward.net.model.language_model, reward.net
    emb = lm.embed_tokens(ids).masked_scatter(
        (ids == reward.video_pad_id)[..., None].expand(-1, -1, lm.config.hidden_size),
        net.model.visual(pixels, grid_thw=grid).pooler_output,
    )
    with torch.no_grad():
        h_default = lm(inputs_embeds=emb, attention_mask=mask).last_hidden_state  # position_ids=None -> arange
        mm = (ids == reward.video_pad_id).int() * 2  # mm_token_type_ids: 2 = video
        pos3, _ = net.model.get_rope_index(ids, mm_token_type_ids=mm, video_grid_thw=grid, attention_mask=mask)
        h_mrope = lm(inputs_embeds=emb, attention_mask=mask, position_ids=pos3).last_hidden_state

    def pool(h):
        """VQ/MQ/TA raw from hidden states."""
        lg = net.rm_head(h)[..., 0]
        return torch.stack([lg[ids == t] for t in reward.special_ids], dim=1)

    ours = reward.raw_scores(v, PROMPTS[:1])
    torch.testing.assert_close(ours, pool(h_default), rtol=0, atol=1e-5)
    assert (ours - pool(h_mrope)).abs().max() > 1e-3


def test_prompt_template_and_tokenisation(reward):
    """Template carries the prompt and the three tokens in order; piecewise ids = ids of the whole chat string."""
    text = build_prompt("a cat")
    pos = [text.index(t) for t in SPECIAL_TOKENS]
    assert pos == sorted(pos) and "Textual prompt - a cat\n" in text
    assert text.startswith("\nYou are tasked with evaluating a generated video")
    ids, mask = reward.build_input_ids(["a cat", "a much longer prompt about dogs"], [5, 5])
    whole = reward.tokenizer(chat_text("a cat", 5), add_special_tokens=False)["input_ids"]
    n = int(mask[0].sum())
    assert ids[0, :n].tolist() == whole and (ids[0, n:] == reward.pad_id).all() and mask[0, n:].sum() == 0
    assert (ids == reward.video_pad_id).sum(-1).tolist() == [5, 5]
    assert chat_text("x", 2) == CHAT_PREFIX + "<|video_pad|>" * 2 + CHAT_SUFFIX.format(text=build_prompt("x"))


def test_in_memory_equals_mp4_round_trip(tmp_path, reward, videos):
    """Scoring in memory == scoring the frames read back from an mp4 written by imageio.

    Lossless RGB H.264: the decoded frames are the uint8-rounded frames, and the in-memory path rounds the same
    way, so scores agree to 1e-5. Lossy yuv420p (what generate scripts write) adds codec error only: at imageio
    quality 8 on these 32x48 clips the mean pixel error is ~0.017 and the tiny random model moves by < 0.3
    (normalised units); we assert that stated tolerance.
    """
    mem = reward(videos, PROMPTS)
    for lossless, tol in ((True, 1e-5), (False, 0.3)):
        back = []
        for i in range(videos.shape[0]):
            p = tmp_path / f"v{i}_{lossless}.mp4"
            write_video(p, videos[i], fps=24, quality=8, lossless=lossless)
            frames, fps = read_video(p)
            assert fps == 24 and frames.shape == videos[i].shape
            back.append(frames)
        disk = reward(torch.stack(back), PROMPTS)
        for k in ("VQ", "MQ", "TA", "Overall"):
            assert (disk[k] - mem[k]).abs().max() <= tol, (lossless, k)


# ---------------------------------------------------------------------------------------------------------------
# user errors
# ---------------------------------------------------------------------------------------------------------------


def _copy(tiny_dirs, tmp_path, name="vr"):  # noqa: F811
    """A writable copy of the old-layout tiny checkpoint."""
    dst = tmp_path / name
    shutil.copytree(tiny_dirs["old"], dst)
    return dst


def test_missing_paths(tiny_dirs, tmp_path):  # noqa: F811
    """Missing dir / config / checkpoints / base config: SageGRPOError saying what to download where."""
    with pytest.raises(SageGRPOError, match="does not exist.*KlingTeam/VideoReward"):
        VideoAlignReward(tmp_path / "nope", tiny_dirs["base"])
    d = _copy(tiny_dirs, tmp_path)
    (d / "model_config.json").unlink()
    with pytest.raises(SageGRPOError, match="model_config.json does not exist"):
        VideoAlignReward(d, tiny_dirs["base"])
    d = _copy(tiny_dirs, tmp_path, "nock")
    for c in d.glob("checkpoint-*"):
        shutil.rmtree(c)
    with pytest.raises(SageGRPOError, match="no checkpoint-<step>/"):
        VideoAlignReward(d, tiny_dirs["base"])
    with pytest.raises(SageGRPOError, match="no config.json in the reward base model.*Qwen2-VL-2B-Instruct"):
        VideoAlignReward(tiny_dirs["old"], tmp_path)


def test_corrupt_files(tiny_dirs, tmp_path):  # noqa: F811
    """Truncated model.pth, a pickled object, broken JSON, a broken adapter: clear SageGRPOError, no unpickling."""
    d = _copy(tiny_dirs, tmp_path)
    pth = d / "checkpoint-8" / "model.pth"
    pth.write_bytes(pth.read_bytes()[:1000])
    with pytest.raises(SageGRPOError, match="corrupt.*re-download"):
        VideoAlignReward(d, tiny_dirs["base"], dtype=torch.float32)
    torch.save({"x": torch.zeros(1), "obj": _Evil()}, pth)  # weights_only=True refuses arbitrary classes
    with pytest.raises(SageGRPOError, match="model.pth"):
        VideoAlignReward(d, tiny_dirs["base"], dtype=torch.float32)
    (d / "model_config.json").write_text("{not json")
    with pytest.raises(SageGRPOError, match="not valid JSON"):
        VideoAlignReward(d, tiny_dirs["base"])
    d = _copy(tiny_dirs, tmp_path, "badlora")
    (d / "checkpoint-8" / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(SageGRPOError, match="adapter_model.safetensors"):
        VideoAlignReward(d, tiny_dirs["base"], weights_form="lora", dtype=torch.float32)


def test_key_and_shape_mismatch_and_missing_base_weights(tiny_dirs, tmp_path):  # noqa: F811
    """A checkpoint missing a tensor, or LoRA form without base weights: messages name keys and the fix."""
    d = _copy(tiny_dirs, tmp_path)
    pth = d / "checkpoint-8" / "model.pth"
    state = torch.load(pth, weights_only=True)
    del state["base_model.model.rm_head.weight"]
    torch.save(state, pth)
    with pytest.raises(SageGRPOError, match=r"1 missing keys.*rm_head.weight.*reward_checkpoint_mode v3"):
        VideoAlignReward(d, tiny_dirs["base"], weights_form="full", dtype=torch.float32)
    base = tmp_path / "base_noweights"
    shutil.copytree(tiny_dirs["base"], base)
    (base / "model.safetensors").unlink()
    with pytest.raises(SageGRPOError, match="needs the base model weights"):
        VideoAlignReward(tiny_dirs["old"], base, weights_form="lora", dtype=torch.float32)


def test_find_checkpoint_form_selection(tiny_dirs, tmp_path):  # noqa: F811
    """auto prefers model.pth; without it the LoRA pair is used; asking for a missing form fails clearly."""
    assert find_checkpoint(tiny_dirs["old"]).form == "full"
    d = _copy(tiny_dirs, tmp_path)
    (d / "checkpoint-8" / "model.pth").unlink()
    assert find_checkpoint(d).form == "lora"
    with pytest.raises(SageGRPOError, match="asked for the full form"):
        find_checkpoint(d, form="full")
    cfg = json.loads((d / "model_config.json").read_text())
    assert cfg["peft_lora_config"]["lora_r"] == 4


class _Evil:
    """An arbitrary class: torch.load(weights_only=True) must refuse to rebuild it."""
