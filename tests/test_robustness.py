"""The bad-input matrix of the training loop (README "Robustness"): failed rewards, NaN gradients, a full disk at
checkpoint time, SIGTERM/SIGINT and kill -9. Each case ends in one clear outcome and leaves every complete
checkpoint intact."""

from __future__ import annotations

import errno
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from post_train_helpers import ROOT, _args, _stable, _weights, pt

from sage_grpo.checkpoint import list_checkpoints, read_train_state
from sage_grpo.errors import SageGRPOError
from sage_grpo.metrics import read_metrics


def _base_weights(model) -> dict[str, torch.Tensor]:
    from sage_grpo.models.loading import load_pipeline

    return load_pipeline(model_path=str(model), dtype="fp32", load_text_encoders=False).transformer.state_dict()


def _with_reward(monkeypatch, nan_rows):
    """Make the rewards of the given rows of every rank's batch NaN (`nan_rows(b)` -> list of rows)."""
    orig = pt.reward_phase

    def wrapped(c, traj):
        real = c.reward

        class Failing:
            components = real.components

            def __call__(self, videos, prompts):
                out = {k: v.clone() for k, v in real(videos, prompts).items()}
                out["total"][nan_rows(len(prompts))] = float("nan")
                return out

            def __getattr__(self, name):  # the composite's weights, optional components, ...
                return getattr(real, name)

        return orig(replace(c, reward=Failing()), traj)

    monkeypatch.setattr(pt, "reward_phase", wrapped)


def test_steps_without_any_finite_reward_train_nothing_and_stop_after_the_limit(tiny_model, tmp_path, monkeypatch):
    _with_reward(monkeypatch, lambda b: list(range(b)))
    with pytest.raises(SageGRPOError, match="no finite reward in the last 2 steps .*checkpoint-2 is saved"):
        pt.main(_args(tiny_model, tmp_path, "--max_steps", "5", "--max_failed_reward_steps", "2"))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    state = read_train_state(list_checkpoints(tmp_path)[0][1])
    assert (state["failed_reward_steps"], state["failed_streak"], state["updates"]) == (2, 2, 0)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["train/failed_reward_steps"] for r in rows] == [1, 2]
    base, trained = _base_weights(tiny_model), _weights(tmp_path)
    assert all(torch.equal(base[k], trained[k]) for k in base)  # no optimizer step on nothing (AdamW would move)


def test_failed_rewards_are_masked_and_counted(tiny_model, tmp_path, monkeypatch):
    _with_reward(monkeypatch, lambda b: [0])  # the first video of the step
    pt.main(_args(tiny_model, tmp_path, "--max_steps", "1"))
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert row["reward/failed"] == 1 and row["train/masked_pairs"] == 4
    assert math.isfinite(row["train/loss"]) and math.isfinite(row["train/grad_norm"])


def test_a_failed_group_is_masked_while_the_others_train(tiny_model, tmp_path, monkeypatch):
    _with_reward(monkeypatch, lambda b: list(range(4)))  # the first group of 4 of a batch of 8
    pt.main(_args(tiny_model, tmp_path, "--max_steps", "1", "--batch_size", "8"))
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert (row["reward/failed"], row["reward/failed_groups"], row["train/skipped_update"]) == (4, 1, 0)
    assert row["train/masked_pairs"] == 4 * 4  # 4 videos x 4 trained steps (grpo_sampling_steps 4, fraction 1)
    assert math.isfinite(row["train/grad_norm"]) and row["train/grad_norm"] > 0


def test_nan_gradients_skip_the_update_and_are_counted(tiny_model, tmp_path, monkeypatch):
    orig = pt.backward_phase

    def poisoned(c, *a, **k):
        nan = torch.full_like(c.step_weights, float("nan"))  # S_t NaN -> NaN loss and gradients
        return orig(replace(c, step_weights=nan), *a, **k)

    monkeypatch.setattr(pt, "backward_phase", poisoned)
    pt.main(_args(tiny_model, tmp_path, "--max_steps", "2"))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["train/skipped_update"] for r in rows] == [1, 1]
    assert [r["train/skipped_updates_total"] for r in rows] == [1, 2]
    assert read_train_state(list_checkpoints(tmp_path)[-1][1])["skipped_updates"] == 2
    base, trained = _base_weights(tiny_model), _weights(tmp_path)
    assert all(torch.equal(base[k], trained[k]) for k in base)


@pytest.mark.slow
def test_a_full_disk_at_checkpoint_time_keeps_the_previous_checkpoint(tiny_model, tmp_path, monkeypatch):
    import sage_grpo.checkpoint as ck

    real = ck.save_file

    def full_disk_at_step_2(tensors, path, *a, **k):
        if "checkpoint-2.tmp" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(ck, "save_file", full_disk_at_step_2)
    with pytest.raises(SageGRPOError, match=r"checkpoint-2 could not be written .*No space left on device.*"
                                            r"last complete one is .*checkpoint-1\. Free space"):
        pt.main(_args(tiny_model, tmp_path, "--max_steps", "3", "--save_interval", "1"))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert not (tmp_path / "checkpoint-2.tmp").exists()
    monkeypatch.setattr(ck, "save_file", real)  # space freed: the run resumes from checkpoint-1
    pt.main(_args(tiny_model, tmp_path, "--max_steps", "3", "--save_interval", "1",
                  "--resume_from_checkpoint", "latest"))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2, 3]


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_stop_signal_finishes_the_step_checkpoints_and_returns(tiny_model, tmp_path, monkeypatch, capsys, sig):
    orig = pt.backward_phase

    def signalled(c, state, *a, **k):
        if state.step == 1:  # during the second step
            os.kill(os.getpid(), sig)
        return orig(c, state, *a, **k)

    monkeypatch.setattr(pt, "backward_phase", signalled)
    pt.main(_args(tiny_model, tmp_path, "--max_steps", "6", "--save_interval", "4"))  # returns: exit 0 from the CLI
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    err = capsys.readouterr()
    assert f"stopped by {sig.name} after step 2" in err.out and "resume_from_checkpoint latest" in err.out
    assert signal.getsignal(sig) is not None and signal.getsignal(sig) != pt.StopRequest._handle  # restored


@pytest.mark.parametrize("gap", [0.02, pytest.param(0.5, marks=pytest.mark.slow)])
def test_a_repeated_signal_within_the_window_is_the_same_request(tiny_model, tmp_path, monkeypatch, capsys, gap):
    """SLURM signals every process of the step and torchrun forwards a copy: two SIGTERMs 20 ms or 500 ms apart
    still finish the step and write the checkpoint (the second was read as "stop now" before)."""
    orig = pt.backward_phase

    def signalled_twice(c, state, *a, **k):
        if state.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(gap)
            os.kill(os.getpid(), signal.SIGTERM)
        return orig(c, state, *a, **k)

    monkeypatch.setattr(pt, "backward_phase", signalled_twice)
    pt.main(_args(tiny_model, tmp_path, "--max_steps", "6"))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    assert "stopped by SIGTERM after step 2" in capsys.readouterr().out


def test_a_signal_after_the_window_stops_at_once(tiny_model, tmp_path, monkeypatch):
    """A person's second Ctrl-C, after the window, interrupts the step (no checkpoint of it)."""
    monkeypatch.setattr(pt.StopRequest, "REPEAT_WINDOW_S", 0.2)
    orig = pt.backward_phase

    def signalled_twice(c, state, *a, **k):
        if state.step == 1:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGINT)
        return orig(c, state, *a, **k)

    monkeypatch.setattr(pt, "backward_phase", signalled_twice)
    with pytest.raises(KeyboardInterrupt):
        pt.main(_args(tiny_model, tmp_path, "--max_steps", "6"))
    assert list_checkpoints(tmp_path) == []


@pytest.mark.slow
def test_kill_9_loses_at_most_the_steps_since_the_last_checkpoint(tiny_model, tmp_path, capsys):
    """A real SIGKILL of a running `python post_train.py` once step 3 is logged, past checkpoint-2; the resumed run
    (post_train.main, in this process) continues from the newest complete checkpoint and ends with the same metrics
    rows as if nothing happened: the rows the killed run wrote after that checkpoint are rewritten, not duplicated."""
    args = _args(tiny_model, tmp_path, "--max_steps", "40", "--save_interval", "2")
    proc = subprocess.Popen([sys.executable, str(ROOT / "post_train.py"), *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "metrics.jsonl"
    try:
        deadline = time.time() + 300
        while not metrics.exists() or len(read_metrics(metrics)) < 3:
            assert proc.poll() is None and time.time() < deadline, "the run ended or stalled before step 3"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    last = list_checkpoints(tmp_path)[-1][0]
    done = len(read_metrics(metrics))
    assert 2 <= last <= done <= last + 2  # at most the steps since the last checkpoint (save_interval) are lost
    capsys.readouterr()
    pt.main(_args(tiny_model, tmp_path, "--max_steps", str(last + 2), "--save_interval", "2",
                  "--resume_from_checkpoint", "latest"))
    assert f"resumed from {tmp_path / f'checkpoint-{last}'} at step {last}" in capsys.readouterr().out
    steps = [row["step"] for row in read_metrics(metrics)]
    assert steps == list(range(1, last + 3))  # rows past the checkpoint were rewritten, not duplicated


def _same_run(a: Path, b: Path) -> None:
    """Two runs ended in the same state: weights, train state (config aside) and metrics rows, bitwise."""
    wa, wb = _weights(a), _weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (read_train_state(list_checkpoints(d)[-1][1]) for d in (a, b))
    assert {k: v for k, v in sa.items() if k != "config"} == {k: v for k, v in sb.items() if k != "config"}
    assert _stable(read_metrics(a / "metrics.jsonl")) == _stable(read_metrics(b / "metrics.jsonl"))


@pytest.mark.slow
def test_a_stop_inside_an_accumulation_resumes_exactly(tiny_model, tmp_path, monkeypatch):
    """gradient_accumulation_steps 2: a SIGTERM in the third round stops after it, half-way into the second update;
    the checkpoint keeps the round's gradient and the resumed run ends bitwise where an uninterrupted one does."""
    extra = ["--max_steps", "4", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3"]
    pt.main(_args(tiny_model, tmp_path / "full", *extra))
    orig = pt.backward_phase

    def signalled(c, state, *a, **k):
        if state.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return orig(c, state, *a, **k)

    monkeypatch.setattr(pt, "backward_phase", signalled)
    pt.main(_args(tiny_model, tmp_path / "half", *extra))
    [(step, path)] = list_checkpoints(tmp_path / "half")
    assert step == 3 and read_train_state(path)["accum_rounds"] == 1 and (path / "gradients" / ".metadata").is_file()
    monkeypatch.setattr(pt, "backward_phase", orig)
    pt.main(_args(tiny_model, tmp_path / "half", *extra, "--resume_from_checkpoint", "latest"))
    _same_run(tmp_path / "full", tmp_path / "half")


@pytest.mark.slow
def test_a_failed_reward_round_counts_toward_the_update_and_resumes_exactly(tiny_model, tmp_path, monkeypatch):
    """gradient_accumulation_steps 2 with no finite reward in the second round: the round still counts (no
    gradient), so the updates stay on steps 2 and 4, the run stopped at step 2 and resumed ends as one that was not."""
    seen = []
    orig_rollout = pt.rollout_phase

    def rollout(c, state):
        seen.append(state.step)
        return orig_rollout(c, state)

    monkeypatch.setattr(pt, "rollout_phase", rollout)
    _with_reward(monkeypatch, lambda b: list(range(b)) if seen[-1] == 1 else [])
    extra = ["--gradient_accumulation_steps", "2", "--learning_rate", "1e-3"]
    pt.main(_args(tiny_model, tmp_path / "full", "--max_steps", "4", *extra))
    rows = read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert [r["reward/failed"] for r in rows] == [0, 4, 0, 0]
    assert [r["train/updates"] for r in rows] == [0, 1, 1, 2] and rows[1]["train/skipped_update"] == 0
    pt.main(_args(tiny_model, tmp_path / "half", "--max_steps", "2", *extra))
    assert read_train_state(list_checkpoints(tmp_path / "half")[-1][1])["accum_rounds"] == 0
    pt.main(_args(tiny_model, tmp_path / "half", "--max_steps", "4", *extra, "--resume_from_checkpoint", "latest"))
    _same_run(tmp_path / "full", tmp_path / "half")


@pytest.mark.slow
def test_a_fixed_lora_anchor_from_a_pretrained_adapter_is_not_the_initial_policy(tiny_model, tmp_path):
    """--pretrained_lora_path with a fixed anchor (the base, adapter disabled): KL_pos is measured from the first
    round, not taken as 0; without a pretrained adapter the initial policy is the base and KL_pos starts at 0."""
    lora = ["--use_lora", "--lora_r", "4", "--lora_alpha", "8", "--use_moving_KL", "False", "--use_dual_kl", "False"]
    pt.main(_args(tiny_model, tmp_path / "pre", "--max_steps", "1", "--learning_rate", "5e-2", *lora))
    adapter = list_checkpoints(tmp_path / "pre")[-1][1] / "lora"
    assert [r["kl/pos"] for r in read_metrics(tmp_path / "pre" / "metrics.jsonl")] == [0.0]
    pt.main(_args(tiny_model, tmp_path / "run", "--max_steps", "1", *lora, "--pretrained_lora_path", str(adapter)))
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[0]["kl/pos"] > 0
