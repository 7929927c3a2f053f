"""sage_grpo/checkpoint.py in one process: atomic writes (tmp, then rename), `latest`, pruning to the total limit,
resume resolution, the exactness report, the layout report of a resume on another number of ranks, the RNG round
trip (and the RNG of a rank the saving run did not have), and a crafted RNG file that is refused unexecuted."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import pytest
import torch

from sage_grpo.checkpoint import (
    CONTENT_KEYS,
    EXACT_KEYS,
    NEUTRAL_REWARD_KEYS,
    RESOLVED_KEYS,
    TRAIN_STATE,
    CheckpointWriteError,
    dcp_load,
    exactness_diff,
    file_digests,
    layout_change,
    list_checkpoints,
    load_rng_state,
    read_train_state,
    resolve_resume,
    resolved_settings,
    save_checkpoint,
)
from sage_grpo.config import Config, RewardConfig, config_to_dict
from sage_grpo.errors import SageGRPOError


def _save(out, step, **kw):
    model = {"w": torch.full((2, 3), float(step)), "b": torch.arange(3.0)}
    return save_checkpoint(out, step, rank=0, model_state=model, optimizer_state={"lr": torch.tensor(0.1 * step)},
                           train_state={"step": step}, **kw)


def test_written_into_tmp_then_renamed_whole(tmp_path):
    seen = {}

    def lora_writer(d):  # runs while the checkpoint is being written
        seen["tmp"], seen["final"] = (tmp_path / "checkpoint-3.tmp").is_dir(), (tmp_path / "checkpoint-3").exists()
        seen["state_before_commit"] = (tmp_path / "checkpoint-3.tmp" / TRAIN_STATE).exists()
        d.mkdir()
        (d / "adapter.txt").write_text("x")

    path = _save(tmp_path, 3, lora_writer=lora_writer)
    assert seen == {"tmp": True, "final": False, "state_before_commit": False}  # train_state.json marks completeness
    assert path == tmp_path / "checkpoint-3" and not (tmp_path / "checkpoint-3.tmp").exists()
    for part in ("transformer/.metadata", "optimizer/.metadata", "rng_rank0.safetensors", "lora/adapter.txt"):
        assert (path / part).is_file(), part
    assert read_train_state(path) == {"step": 3}
    back = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    dcp_load({"model": back}, path / "transformer", "model")
    assert torch.equal(back["w"], torch.full((2, 3), 3.0)) and torch.equal(back["b"], torch.arange(3.0))
    with pytest.raises(SageGRPOError, match="does not fit this run's model"):
        dcp_load({"model": {"w": torch.zeros(3, 3), "b": torch.zeros(3)}}, path / "transformer", "model")


def test_a_failed_write_leaves_no_partial_folder_and_older_checkpoints_intact(tmp_path):
    _save(tmp_path, 1)

    def broken(d):
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointWriteError, match="checkpoint-2 could not be written .*No space left on device"):
        _save(tmp_path, 2, lora_writer=broken)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def test_latest_on_a_fresh_clone_starts_fresh_and_only_a_path_under_a_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a fresh clone: no outputs/ yet (AUTO_RESUME=1 bash run_post_train.sh, or restarts)
    for out in ("./outputs/single_node", "outputs/multinode", str(tmp_path / "runs" / "a" / "b")):
        assert resolve_resume("latest", out) is None  # a first run: starts at step 0, in a folder setup creates
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # resolving creates nothing
    (tmp_path / "notes.txt").write_text("")
    for out in ("notes.txt", "notes.txt/run", str(tmp_path / "notes.txt" / "a" / "run")):
        with pytest.raises(SageGRPOError, match=r"can never be a run folder: .*notes\.txt is a file"):
            resolve_resume("latest", out)


def test_latest_and_explicit_resume(tmp_path):
    assert resolve_resume("", tmp_path) is None
    assert resolve_resume("latest", tmp_path / "nothing_yet") is None
    for step in (2, 10):
        _save(tmp_path, step)
    (tmp_path / "checkpoint-20.tmp").mkdir()  # a write that died half-way
    (tmp_path / "checkpoint-30").mkdir()  # no train_state.json: incomplete
    (tmp_path / "notes-40").mkdir()
    assert list_checkpoints(tmp_path) == [(2, tmp_path / "checkpoint-2"), (10, tmp_path / "checkpoint-10")]
    assert resolve_resume("latest", tmp_path) == tmp_path / "checkpoint-10"  # numeric order, not text order
    assert resolve_resume(str(tmp_path / "checkpoint-2"), tmp_path) == tmp_path / "checkpoint-2"
    with pytest.raises(SageGRPOError, match="is not a complete checkpoint"):
        resolve_resume(str(tmp_path / "checkpoint-30"), tmp_path)


def test_total_limit_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, total_limit=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    _save(tmp_path, 5)  # 0 keeps all
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4, 5]


def test_exactness_diff_names_the_settings_that_change_the_continuation():
    saved = {"rollout": {"eta": 0.5, "height": 352}, "optim": {"learning_rate": 1e-5, "max_steps": 100},
             "logging": {"log_interval": 1}, "model": {"lora_r": 8, "pretrained_model_root": "a"}}
    same = json.loads(json.dumps(saved))
    assert exactness_diff(saved, same) == []
    current = json.loads(json.dumps(saved))
    current["rollout"]["eta"] = 0.3  # every rollout key counts
    current["optim"]["learning_rate"] = 2e-5
    current["optim"]["max_steps"] = 200  # a longer run continues exactly
    current["logging"]["log_interval"] = 5
    current["model"]["pretrained_model_root"] = "b"  # where the weights are, not what they are
    current["model"]["lora_r"] = 16
    assert exactness_diff(saved, current) == ["model.lora_r: 8 -> 16", "rollout.eta: 0.5 -> 0.3",
                                              "optim.learning_rate: 1e-05 -> 2e-05"]


def _state(world_size, sp=1, batch_size=2, replicate=1, g=4):
    cfg = config_to_dict(Config())
    cfg["parallel"].update(sp_size=sp, dp_replicate=replicate)
    cfg["data"].update(batch_size=batch_size, num_generations=g)
    return {"world_size": world_size, "config": cfg}


def test_a_resume_on_another_layout_says_what_changed():
    """The same layout says nothing; the same videos per step on other ranks is exact up to the reduction order
    (and not an exactness difference); other videos per step are named with the batch size that keeps them."""
    saved = _state(8, sp=2, batch_size=2)  # dp 4: 8 videos, 2 prompts per step
    assert layout_change(saved, saved["config"], 8) is None
    assert layout_change({"config": saved["config"]}, _state(4)["config"], 4) is None  # predates "world_size"
    same = _state(4, sp=2, batch_size=4)["config"]
    line = layout_change(saved, same, 4, "checkpoint-6")
    assert line.startswith("checkpoint-6 was written on another layout: world size 8 -> 4, batch_size per rank 2 -> 4 "
                           "(data-parallel ranks 4 -> 2); the same 8 videos (2 prompts) per step")
    assert "exact up to the new layout's reduction order" in line
    assert exactness_diff(saved["config"], same, saved_dp=4, current_dp=2) == []
    assert "sp_size 2 -> 1, dp_replicate 1 -> 2" in layout_change(saved, _state(4, replicate=2)["config"], 4)
    fewer = _state(4, sp=2, batch_size=2)["config"]  # the same flags on half the GPUs: half the videos
    line = layout_change(saved, fewer, 4)
    assert "NOT the same batch: 8 -> 4 videos (2 -> 1 prompts) per step" in line
    assert line.endswith("pass --batch_size 4 to keep them")
    assert exactness_diff(saved["config"], fewer, saved_dp=4, current_dp=2) == [
        "data.batch_size: 2 -> 2 (videos per step 8 -> 4 on 4 -> 2 data-parallel ranks)"]


def test_exactness_diff_missing_keys_count_as_their_defaults():
    """A checkpoint written before --reward_combine, --reward_optional and the judge flags existed resumed with
    their defaults is exact; with another value, the change is named against the default."""
    saved = config_to_dict(Config())
    for k in ("reward_combine", "reward_optional", "judge_model", "judge_template", "judge_scale", "judge_frames",
              "judge_video"):
        del saved["reward"][k]
    del saved["rollout"]["sde_window_start"]  # a group where every key counts
    assert exactness_diff(saved, config_to_dict(Config())) == []
    cfg = Config()
    cfg.reward.reward_combine = "component_norm"
    assert exactness_diff(saved, config_to_dict(cfg)) == ["reward.reward_combine: 'weighted_sum' -> 'component_norm'"]


def test_switching_the_fp8_base_on_resume_is_reported_as_not_exact():
    """--fp8_base True -> False (or the FP8 products on or off) changes every sample and gradient: named."""
    saved = config_to_dict(Config())
    saved["model"].update(use_lora=True, fp8_base=True, fp8_matmul=True)
    current = json.loads(json.dumps(saved))
    current["model"]["fp8_matmul"] = False
    assert exactness_diff(saved, current) == ["model.fp8_matmul: True -> False"]
    current["model"]["fp8_base"] = False
    assert exactness_diff(saved, current) == ["model.fp8_base: True -> False", "model.fp8_matmul: True -> False"]


def test_exactness_diff_names_every_judge_setting_that_changes_the_score():
    saved = config_to_dict(Config())
    changes = {"judge_model": "other-vlm", "judge_scale": "yes_no", "judge_frames": 8, "judge_video": True,
               "judge_template": "t.txt"}
    for k, v in changes.items():
        current = config_to_dict(Config())
        current["reward"][k] = v
        assert exactness_diff(saved, current) == [f"reward.{k}: {saved['reward'][k]!r} -> {v!r}"], k
    current = config_to_dict(Config())  # where the server is and how many requests fly: the same scores
    current["reward"].update(judge_url="http://other:8000", judge_concurrency=2)
    assert exactness_diff(saved, current) == []


def test_judge_template_is_compared_by_its_content(tmp_path):
    """The same text at another path is exact; the same path with edited text is not; a checkpoint without digests
    (written before them) compares the path."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("Rate {prompt} from 1 to 10.")
    b.write_text("Rate {prompt} from 1 to 10.")
    saved, moved = config_to_dict(Config()), config_to_dict(Config())
    saved["reward"]["judge_template"], moved["reward"]["judge_template"] = str(a), str(b)
    digests = file_digests(saved)
    assert len(digests["reward.judge_template"]) == 64
    assert exactness_diff(saved, moved, digests, file_digests(moved)) == []
    a.write_text("Rate {prompt} from 1 to 10. Be strict.")
    assert exactness_diff(saved, saved, digests, file_digests(saved)) == [
        f"reward.judge_template: {str(a)!r} -> {str(a)!r} (its content differs)"]
    assert exactness_diff(saved, moved, None, file_digests(moved)) == [
        f"reward.judge_template: {str(a)!r} -> {str(b)!r}"]


def test_the_judges_model_is_compared_as_used():
    """--judge_model "" asks for the one model the judge server lists: a resume against a server of another model is
    not exact, though the flag is the same; naming the model that was listed is. A checkpoint that recorded none
    compares the flag."""
    judged = SimpleNamespace(rewards={"brightness": object(), "vlm_judge": SimpleNamespace(model="qwen-vl-7b")})
    assert resolved_settings(judged) == {"reward.judge_model": "qwen-vl-7b"}
    assert resolved_settings(SimpleNamespace(rewards={"brightness": object()})) == {}
    saved, named = config_to_dict(Config()), config_to_dict(Config())
    named["reward"]["judge_model"] = "qwen-vl-7b"
    used = {"reward.judge_model": "qwen-vl-7b"}
    assert exactness_diff(saved, saved, saved_resolved=used, current_resolved={"reward.judge_model": "llava-13b"}) == [
        "reward.judge_model: '' -> '' (used: 'qwen-vl-7b' -> 'llava-13b')"]
    assert exactness_diff(saved, saved, saved_resolved=used, current_resolved=used) == []
    assert exactness_diff(saved, named, saved_resolved=used, current_resolved=used) == []
    assert exactness_diff(saved, named, saved_resolved=None, current_resolved=used) == [
        "reward.judge_model: '' -> 'qwen-vl-7b'"]


def test_every_reward_flag_is_classified_as_score_changing_or_not():
    """A new reward flag must be put into EXACT_KEYS["reward"] (it changes a score) or NEUTRAL_REWARD_KEYS (it does
    not): forgotten, a resume that changes the reward would report itself exact."""
    import dataclasses

    exact, neutral = set(EXACT_KEYS["reward"]), set(NEUTRAL_REWARD_KEYS)
    assert not exact & neutral
    assert {f.name for f in dataclasses.fields(RewardConfig)} == exact | neutral
    assert all(k in EXACT_KEYS[g] for g, k in (*CONTENT_KEYS, *RESOLVED_KEYS))


def test_rng_state_round_trip(tmp_path):
    torch.manual_seed(1234)
    path = _save(tmp_path, 1)
    want = torch.rand(4)  # the draws that follow the save
    torch.manual_seed(999)
    load_rng_state(path, rank=0)
    assert torch.equal(torch.rand(4), want)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    assert not load_rng_state(path, rank=3)  # saved with another world size: no file for this rank, the state is kept
    assert torch.equal(torch.get_rng_state(), before)
    # given the run's seed, a rank the saving run did not have seeds from (seed, step, rank): the same every launch,
    # another per rank
    states = []
    for rank in (3, 3, 4):
        torch.manual_seed(rank * 11)
        assert not load_rng_state(path, rank=rank, seed=42, step=5)
        states.append(torch.get_rng_state())
    assert torch.equal(states[0], states[1]) and not torch.equal(states[0], states[2])
    assert not torch.equal(states[0], before)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling would create the marker file
        return (open, (str(self.marker), "w"))


def test_a_crafted_pickle_as_rng_file_is_refused_without_running(tmp_path):
    path = _save(tmp_path, 1)
    marker = tmp_path / "pwned"
    (path / "rng_rank0.safetensors").write_bytes(pickle.dumps(_Payload(marker)))
    before = torch.get_rng_state()
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own error type: not a safetensors header
        load_rng_state(path, rank=0)
    assert not marker.exists() and torch.equal(torch.get_rng_state(), before)
