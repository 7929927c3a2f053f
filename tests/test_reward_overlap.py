"""Scoring overlapped with the rollout (--reward_overlap, docs/rewards.md "Overlap") beyond the remote reward: which
rewards overlap, a local reward on the CPU scored in a worker thread in one process, and Ulysses sp 2 on two gloo
ranks (each sp rank scores its share of every chunk); overlapped and in order give the same metrics and weights,
bitwise. The remote reward's overlap: tests/test_rewards_remote.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from post_train_helpers import ROOT, _args, _stable, _weights, pt

from sage_grpo.metrics import read_metrics
from sage_grpo.rewards import build_reward
from sage_grpo.rewards.overlap import EarlyScores

# brightness computed on the CPU, saying so; each call appends "rank thread videos device start" to <file>.<rank>.log
CPU_REWARD = """
import os, threading, time
from pathlib import Path
from sage_grpo.rewards.builtin import BrightnessReward
class CpuBrightness(BrightnessReward):
    components = ("cpu_brightness",)
    default_weights = {"cpu_brightness": 1.0}
    runs_on_cpu = True
    def __call__(self, videos, prompts):
        rank = os.environ.get("RANK", "0")
        with open(Path(__file__).with_suffix(f".{rank}.log"), "a") as f:
            f.write(f"{rank} {threading.current_thread().name} {len(prompts)} {videos.device.type} "
                    f"{time.monotonic()}\\n")
        return {"cpu_brightness": super().__call__(videos, prompts)["brightness"]}
def build(**kw):
    return CpuBrightness()
"""


def _plugin(folder, name):
    """The CPU reward as `<folder>/<name>.py` -> (its --reward_model spec, its calls of rank r: [(thread, videos,
    device, start)])."""
    path = folder / f"{name}.py"
    path.write_text(CPU_REWARD)

    def calls(rank=0):
        log = path.with_suffix(f".{rank}.log")
        rows = [line.split() for line in log.read_text().splitlines()]
        return [(thread, int(n), device, float(t)) for _, thread, n, device, t in rows]

    return f"{path}:build", calls


@pytest.mark.parametrize(("rewards", "overlaps"), [
    ("world_size", True), ("world_motion,world_caption", True), ("brightness", False),
    ("world_size,brightness", False), ("world_color_share", False)])
def test_rewards_overlap_when_every_one_works_on_the_cpu(rewards, overlaps):
    reward = build_reward(rewards, reward_weights=None)
    cfg = SimpleNamespace(reward=SimpleNamespace(reward_overlap=True), data=SimpleNamespace(batch_size=4),
                          optim=SimpleNamespace(mini_batch_size_per_update=1))
    assert reward.runs_on_cpu is overlaps
    assert pt.overlaps_reward(SimpleNamespace(cfg=cfg, reward=reward)) is overlaps
    cfg.reward.reward_overlap = False  # the flag turns it off
    assert pt.overlaps_reward(SimpleNamespace(cfg=cfg, reward=reward)) is False
    cfg.reward.reward_overlap, cfg.data.batch_size = True, 1  # one chunk: nothing to overlap
    assert pt.overlaps_reward(SimpleNamespace(cfg=cfg, reward=reward)) is False


def _early_scores(reward) -> EarlyScores:
    """EarlyScores of ``reward`` on one rank, no sp, the CPU (no VAE: the tests replace decode_latents)."""
    return EarlyScores(reward, SimpleNamespace(sp_size=1, sp_rank=0, device=torch.device("cpu")), None)


def test_each_overlapped_chunk_is_scored_with_its_own_prompts(monkeypatch):
    """Chunks of 2 of 6 videos: each chunk's reward call gets its own videos' prompts (a later chunk given the
    step's first prompts would score its videos against the wrong texts, and brightness, which reads no prompt,
    would not tell)."""
    import sage_grpo.rollout

    monkeypatch.setattr(sage_grpo.rollout, "decode_latents", lambda vae, latents: latents)  # "frames" = latents

    def reward(frames, prompts):  # the video's number, as its frames and as its prompt say
        return {"total": frames.flatten(1).mean(1), "prompt": torch.tensor([float(p[1:]) for p in prompts])}

    early = _early_scores(reward)
    early.start([f"p{i}" for i in range(6)])
    latents = torch.arange(6.0).view(6, 1, 1, 1, 1).expand(6, 2, 1, 2, 2)  # video i holds i
    for lo in (0, 2, 4):
        early.submit(torch.arange(lo, lo + 2), latents[lo : lo + 2])
    got = early.collect(["prompt", "total"], 6)  # [6, K]
    assert got.tolist() == [[float(i)] * 2 for i in range(6)]
    early.worker.join(timeout=60)  # every chunk is scored: the worker ended
    assert not early.worker.is_alive()


BLOCKED = """
import sys, threading, types, torch
sys.path.insert(0, {root!r})
import sage_grpo.rollout
from sage_grpo.rewards.overlap import EarlyScores
sage_grpo.rollout.decode_latents = lambda vae, latents: latents
calls = []
def reward(frames, prompts):  # a judge or server that never answers
    calls.append(prompts)
    print("scoring", prompts, flush=True)
    threading.Event().wait()
info = types.SimpleNamespace(sp_size=1, sp_rank=0, device=torch.device("cpu"))
with EarlyScores(reward, info, None) as early:
    early.start(["a", "b", "c"])
    for i in range(3):
        early.submit(torch.tensor([i]), torch.zeros(1, 1, 1, 2, 2))
    while not calls:  # the first chunk is being scored, the others queued
        threading.Event().wait(0.01)
    raise RuntimeError("the rollout failed")
"""


@pytest.mark.slow  # ~9 s on 2 loaded cores: a fresh interpreter imports torch
def test_a_failing_rollout_ends_the_process_without_waiting_for_a_blocked_reward(tmp_path):
    """The rollout raises while the worker scores a chunk that never ends and two more are queued: the process ends
    with the rollout's error (the queued chunks cancelled, the blocked one not waited for, at exit neither; a
    ThreadPoolExecutor's worker is joined at exit, which here would be for ever)."""
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED.format(root=str(ROOT)))
    # a hang is the failure: the timeout is only there to end it (the run takes a few seconds, the import of torch)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1 and r.stderr.rstrip().endswith("RuntimeError: the rollout failed"), r.stderr[-2000:]
    assert r.stdout.splitlines() == ["scoring ['a']"]  # the queued chunks were cancelled, never scored


@pytest.mark.slow
def test_a_local_cpu_reward_scores_in_a_worker_thread_as_in_order(tiny_model, tmp_path, monkeypatch):
    """4 videos a step in chunks of 1, 2 steps: overlapped, each chunk is scored on CPU frames in the worker thread,
    the first while later chunks still sample; in order, one call a step on the main thread. Metrics and trained
    weights equal bitwise."""
    monkeypatch.chdir(ROOT)
    handed = []
    submit = EarlyScores.submit

    def timed_submit(self, *a):
        handed.append(__import__("time").monotonic())
        return submit(self, *a)

    monkeypatch.setattr(EarlyScores, "submit", timed_submit)
    for overlap in ("true", "false"):
        spec, calls = _plugin(tmp_path, f"cpu_{overlap}")
        pt.main(_args(tiny_model, tmp_path / overlap, "--reward_model", spec, "--reward_weights",
                      '{"cpu_brightness":1.0}', "--reward_overlap", overlap))
        scoring = calls()[1:]  # the first call is the start-up probe of a user's reward
        if overlap == "true":
            assert [(th, n, dev) for th, n, dev, _ in scoring] == [("reward_0", 1, "cpu")] * 8  # 2 steps x 4 chunks
            assert len(handed) == 8
            assert scoring[0][3] < handed[3] and scoring[4][3] < handed[7]  # scoring began before the last chunk
        else:
            assert [(th, n) for th, n, _, _ in scoring] == [("MainThread", 4)] * 2
    a, b = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("true", "false"))
    assert len(a) == 2 and a[0]["reward/cpu_brightness_std"] > 0 and _stable(a) == _stable(b)
    wa, wb = _weights(tmp_path / "true"), _weights(tmp_path / "false")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.dist
def test_sp2_overlapped_scoring_shares_each_chunk_and_equals_in_order(tiny_model, tmp_path):
    """torchrun, 2 gloo ranks, --sp_size 2 with FSDP2 (one data-parallel rank, both ranks hold the same 4 videos),
    chunks of 1, one step. Overlapped, sp rank r decodes and scores videos r and r + 2 in its worker thread (2 of
    the 4 chunks) while both ranks make the same forwards; in order, each scores its contiguous half on the main
    thread. The runs agree bitwise (metrics, weights)."""
    specs = {o: _plugin(tmp_path, f"cpu_{o}") for o in ("true", "false")}
    flags = ["--sp_size", "2", "--batch_size", "4", "--enable_fsdp", "True", "--max_steps", "1", "--reward_weights",
             '{"cpu_brightness":1.0}']
    runs = [_args(tiny_model, tmp_path / o, *flags, "--reward_model", specs[o][0], "--reward_overlap", o)
            for o in ("true", "false")]
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(ROOT / "tests/dist_workers/post_train_runs_worker.py"), str(spec)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        overlapped = [(th, n, dev) for th, n, dev, _ in specs["true"][1](rank)[1:]]  # [0]: the start-up probe
        assert overlapped == [("reward_0", 1, "cpu")] * 2  # its 2 of the 4 chunks
        assert [(th, n) for th, n, _, _ in specs["false"][1](rank)[1:]] == [("MainThread", 2)]
    a, b = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("true", "false"))
    assert len(a) == 1 and a[0]["reward/cpu_brightness_std"] > 0 and _stable(a) == _stable(b)
    wa, wb = _weights(tmp_path / "true"), _weights(tmp_path / "false")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
