"""The reward server (scripts/serve_reward.py, a real process on 127.0.0.1) and `--reward_model remote`: scores equal
local ones, training equals local training, a killed server ends in NaN, a clean stop and a resume, a slow one in a
timeout, a wrong token in one line, concurrent clients batched together, and no pickle is ever accepted."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch
from helpers import TINY_MIN_PIXELS, free_port, load_script, serve, smooth_videos
from post_train_helpers import ROOT, _args, _stable, _weights, kill_before_rollout, pt

from sage_grpo.checkpoint import list_checkpoints
from sage_grpo.config import load_config, validate
from sage_grpo.errors import SageGRPOError
from sage_grpo.metrics import read_metrics
from sage_grpo.rewards import build_reward
from sage_grpo.rewards.overlap import EarlyScores
from sage_grpo.rewards.remote import RemoteReward, apply_read, encode_batch, wire_dtype

EXAMPLE = "examples/rewards/colorfulness.py:build"
TOKEN = "s3cret-token"
SLOW = """
import os, time
from sage_grpo.rewards.builtin import BrightnessReward
class Slow(BrightnessReward):
    def __call__(self, videos, prompts):
        per_video = float(os.environ.get("SLOW_REWARD_S_PER_VIDEO", "0"))
        time.sleep(float(os.environ.get("SLOW_REWARD_S", "0")) + per_video * len(prompts))
        return super().__call__(videos, prompts)
def build(**kw):
    return Slow()
"""


@pytest.fixture(scope="module")
def server():
    """brightness and the example reward behind a token; requests within 300 ms of each other share a batch."""
    with serve("--reward_model", f"brightness,{EXAMPLE}", "--batch_wait_ms", "300", token=TOKEN) as (url, _):
        yield url


def _client(url, **kw) -> RemoteReward:
    return RemoteReward([url], token=TOKEN, **kw)


def test_scores_through_the_server_equal_local_scores(server):
    local = build_reward(f"brightness,{EXAMPLE}", reward_weights="")
    remote = _client(server)
    assert remote.components == ("brightness", "colorfulness")
    assert remote.default_weights == {"brightness": 1.0, "colorfulness": 1.0}
    for videos in (smooth_videos(3, 9, 32, 48, seed=1), torch.rand(2, 5, 3, 16, 24)):
        prompts = [f"p{i}" for i in range(len(videos))]
        want, got = local(videos, prompts), remote(videos, prompts)
        for k in remote.components:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
            assert got[k].dtype == torch.float32


@pytest.mark.slow
def test_videoalign_scores_through_the_server_equal_local_ones_and_only_its_frames_travel(tiny_dirs):
    flags = ["--model_path", str(tiny_dirs["old"]), "--base_model_path", str(tiny_dirs["base"]), "--dtype", "fp32",
             "--min_pixels", str(TINY_MIN_PIXELS), "--video_fps", "24"]
    local = build_reward("videoalign_local", reward_weights="", reward_model_path=tiny_dirs["old"],
                         reward_base_model_path=tiny_dirs["base"], dtype="fp32", min_pixels=TINY_MIN_PIXELS)
    videos, prompts = smooth_videos(2, 33, 64, 96, seed=3), ["a red fox", "a calm sea"]
    with serve("--reward_model", "videoalign_local", *flags) as (url, _):
        remote = RemoteReward([url], token="", video_fps=24)
        spec = remote.servers[0].read_spec
        got = remote(videos, prompts)
        with pytest.raises(SageGRPOError, match="samples frames as if videos had 24 fps, but these have 12: restart "
                                                "it with --video_fps 12"):
            RemoteReward([url], token="", video_fps=12)
    want = local(videos, prompts)
    for k in local.components:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
    sent = apply_read(spec, videos)
    assert sent.shape[1] == 4 and sent.shape[-2:] != videos.shape[-2:]  # 33 frames at 24 fps -> 4, resized
    small, whole = len(encode_batch(sent, prompts, wire_dtype(spec))), len(encode_batch(videos, prompts))
    assert small * 10 < whole, (small, whole)  # frames it reads, as uint8


def test_two_concurrent_clients_are_batched_together_and_get_their_own_scores(server):
    local = build_reward(f"brightness,{EXAMPLE}", reward_weights="")
    clients = [_client(server), _client(server)]
    videos = [smooth_videos(2, 5, 16, 16, seed=s) for s in (10, 11)]
    before = httpx.get(f"{server}/health").json()
    results, barrier = [None, None], threading.Barrier(2)

    def run(i):
        barrier.wait()
        results[i] = clients[i](videos[i], ["a", "b"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = httpx.get(f"{server}/health").json()
    assert after["requests"] - before["requests"] == 2
    assert after["batches"] - before["batches"] == 1  # scored as one batch of 4 videos
    for i in range(2):
        want = local(videos[i], ["a", "b"])
        for k in ("brightness", "colorfulness"):
            torch.testing.assert_close(results[i][k], want[k], rtol=0, atol=1e-6)


def test_wrong_or_missing_token_is_one_line_before_the_policy_loads(server, tiny_model, tmp_path, monkeypatch):
    with pytest.raises(SageGRPOError, match=r"refused the token \(401\): set SAGE_REWARD_TOKEN") as err:
        RemoteReward([server], token="wrong", retries=0)
    assert "\n" not in str(err.value)
    monkeypatch.delenv("SAGE_REWARD_TOKEN", raising=False)

    def never(*a, **k):
        raise AssertionError("the policy was loaded before the reward server was checked")

    monkeypatch.setattr(pt, "load_policy", never)
    with pytest.raises(SageGRPOError, match="refused the token"):
        pt.main(_args(tiny_model, tmp_path, "--reward_model", "remote", "--reward_url", server))
    assert httpx.get(f"{server}/health").status_code == 200  # /health needs no token


def test_the_server_refuses_malformed_bodies_and_pickles(server):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    pickled = zlib.compress(pickle.dumps({"frames": torch.zeros(1, 2, 3, 4, 4), "prompts": ["a"]}))
    for body in (pickled, pickle.dumps([1]), b"", zlib.compress(b"not safetensors")):
        r = httpx.post(f"{server}/score", content=body, headers=auth)
        assert r.status_code == 400 and "malformed" in r.json()["detail"]
    r = httpx.post(f"{server}/score", content=encode_batch(torch.zeros(2, 2, 3, 4, 4), ["one prompt"]), headers=auth)
    assert r.status_code == 400 and "for 1 prompts" in r.json()["detail"]
    r = httpx.post(f"{server}/score", content=encode_batch(torch.zeros(1, 3, 4, 4), ["a"]), headers=auth)
    assert r.status_code == 400 and "expected videos" in r.json()["detail"]


def test_a_too_slow_server_times_out_and_its_videos_score_nan(tmp_path):
    plugin = tmp_path / "slow.py"
    plugin.write_text(SLOW)
    with serve("--reward_model", f"{plugin}:build", env={"SLOW_REWARD_S": "3"}) as (url, _):
        remote = RemoteReward([url], token="", timeout=0.5, retries=1, backoff=0.1)
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning, match=r"failed 2 time\(s\) on a batch of 2 .*ReadTimeout"):
            out = remote(smooth_videos(2, 5, 16, 16), ["a", "b"])
        assert time.monotonic() - t0 < 2.5
    assert torch.isnan(out["brightness"]).all()


class _Trickling(BaseHTTPRequestHandler):
    """A reward server that answers /info at once and /score a byte every `server.every` seconds: its headers too
    (`server.head`), or only its body."""

    def log_message(self, *a):  # quiet
        pass

    def answer(self, body: dict, every: float = 0.0, head: bool = False) -> None:
        data = json.dumps(body).encode()
        # "Connection: close": this handler speaks HTTP/1.0 and closes after each answer; without it the client
        # would keep the connection for the next request and race the close (a disconnect instead of a timeout).
        raw = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
               "Connection: close\r\n\r\n").encode()
        if not head:
            self.wfile.write(raw)
            raw = b""
        with contextlib.suppress(ConnectionError):  # the client gave up
            for byte in raw + data:
                self.wfile.write(bytes([byte]))
                time.sleep(every)

    def do_GET(self):
        self.answer({"components": ["brightness"], "default_weights": {"brightness": 1.0}, "version": "1"})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.answer({"scores": {"brightness": [0.5]}}, self.server.every, self.server.head)


@pytest.mark.parametrize("head, every", [(True, 0.25), (False, 0.9)])
def test_a_request_ends_at_the_timeout_however_slowly_its_headers_or_body_come(head, every):
    """httpx's timeout bounds each read: headers a byte every 0.25 s held a 1-second request for their whole length,
    and so did a body whose bytes come just under the timeout apart. The whole try ends at --reward_timeout."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Trickling)
    srv.daemon_threads, srv.every, srv.head = True, every, head
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        remote = RemoteReward([f"http://127.0.0.1:{srv.server_address[1]}"], token="", timeout=1.0, retries=0)
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning, match=r"failed 1 time\(s\) on a batch of 1 .*ReadTimeout"):
            out = remote(smooth_videos(1, 5, 16, 16), ["a"])
        assert time.monotonic() - t0 < 1.5 and torch.isnan(out["brightness"]).all()
    finally:
        srv.shutdown()
        srv.server_close()


def test_remote_flags_are_checked_before_anything_runs():
    def check(*argv):
        validate(load_config(["--config", str(ROOT / "configs/tiny_cpu.yaml"), *argv]), world_size=1)

    with pytest.raises(SageGRPOError, match="remote needs --reward_url"):
        check("--reward_model", "remote")
    with pytest.raises(SageGRPOError, match="--reward_url is only used by --reward_model remote"):
        check("--reward_url", "http://127.0.0.1:1")
    with pytest.raises(SageGRPOError, match="must start with http"):
        check("--reward_model", "remote", "--reward_url", "127.0.0.1:8000")
    with pytest.raises(SageGRPOError, match=r"reward server http://127.0.0.1:\d+ cannot be reached \(ConnectError"):
        RemoteReward([f"http://127.0.0.1:{free_port()}"], retries=0)


@pytest.mark.slow
def test_training_with_a_remote_reward_equals_training_with_the_local_reward(server, tiny_model, tmp_path,
                                                                             monkeypatch):
    """Bitwise: the same metrics and weights, with the scoring overlapped with the rollout (a request per chunk of
    --mini_batch_size_per_update 1 video) and in order (one request per step)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("SAGE_REWARD_TOKEN", TOKEN)
    weights = ["--reward_weights", '{"brightness":1.0,"colorfulness":0.5}']
    pt.main(_args(tiny_model, tmp_path / "local", "--reward_model", f"brightness,{EXAMPLE}", *weights))
    a = read_metrics(tmp_path / "local" / "metrics.jsonl")
    assert len(a) == 2 and a[0]["reward/colorfulness_mean"] > 0
    for overlap, requests in (("true", 8), ("false", 2)):
        before = httpx.get(f"{server}/health").json()["requests"]
        pt.main(_args(tiny_model, tmp_path / overlap, "--reward_model", "remote", "--reward_url", server, *weights,
                      "--reward_overlap", overlap))
        assert httpx.get(f"{server}/health").json()["requests"] - before == requests
        assert _stable(read_metrics(tmp_path / overlap / "metrics.jsonl")) == _stable(a)
        wa, wb = _weights(tmp_path / "local"), _weights(tmp_path / overlap)
        assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_a_killed_server_gives_nan_then_a_clean_stop_with_a_checkpoint_and_a_resume(tiny_model, tmp_path,
                                                                                    monkeypatch):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    monkeypatch.delenv("SAGE_REWARD_TOKEN", raising=False)
    flags = ["--reward_model", "remote", "--reward_url", url, "--reward_retries", "0", "--reward_timeout", "5",
             "--max_steps", "4", "--max_failed_reward_steps", "2"]
    with serve("--reward_model", "brightness", port=port) as (_, proc):
        orig = kill_before_rollout(monkeypatch, proc, at=2)
        with pytest.raises(SageGRPOError, match="no finite reward in the last 2 steps .*checkpoint-3 is saved"):
            pt.main(_args(tiny_model, tmp_path, *flags))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["reward/failed"] for r in rows] == [0, 4, 4]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3]
    monkeypatch.setattr(pt, "rollout_phase", orig)
    with serve("--reward_model", "brightness", port=port):  # back: the run goes on from checkpoint-3
        pt.main(_args(tiny_model, tmp_path, *flags, "--resume_from_checkpoint", "latest"))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[-1]["reward/failed"] == 0 and [s for s, _ in list_checkpoints(tmp_path)][-1] == 4



@pytest.mark.slow
def test_overlapped_scoring_starts_while_the_rollout_still_samples(tiny_model, tmp_path, monkeypatch):
    """A server that takes 0.12 s a video, 8 videos a step in chunks of 2. With --reward_overlap true the rollout
    hands over 4 chunks a step and the first chunk's scoring starts before the last chunk is sampled; with false the
    step's 8 videos go in one request after the whole rollout. The order of events, not the speed (that is
    scripts/bench_reward_overlap.py's, docs/rewards.md)."""
    plugin = tmp_path / "slow.py"
    plugin.write_text(SLOW)
    monkeypatch.delenv("SAGE_REWARD_TOKEN", raising=False)
    sampled, scored = [], []  # chunk handed over: time; request: (start, end, videos)
    submit, call = EarlyScores.submit, RemoteReward.__call__

    def timed_submit(self, *a):
        sampled.append(time.monotonic())
        return submit(self, *a)

    def timed_call(self, videos, prompts):
        start = time.monotonic()
        out = call(self, videos, prompts)
        scored.append((start, time.monotonic(), len(prompts)))
        return out

    monkeypatch.setattr(EarlyScores, "submit", timed_submit)
    monkeypatch.setattr(RemoteReward, "__call__", timed_call)
    with serve("--reward_model", f"{plugin}:build", env={"SLOW_REWARD_S_PER_VIDEO": "0.12"}) as (url, _):
        for overlap in ("true", "false"):
            sampled.clear()
            scored.clear()
            pt.main(_args(tiny_model, tmp_path / overlap, "--reward_model", "remote", "--reward_url", url,
                          "--batch_size", "8", "--mini_batch_size_per_update", "2", "--reward_overlap", overlap))
            assert all(r["reward/failed"] == 0 for r in read_metrics(tmp_path / overlap / "metrics.jsonl"))
            if overlap == "true":
                assert len(sampled) == 8 and [n for _, _, n in scored] == [2] * 8  # 2 steps x 4 chunks
                for step in (0, 1):
                    first_request_start = scored[4 * step][0]
                    assert first_request_start < sampled[4 * step + 3], (sampled, scored)
            else:
                assert sampled == [] and [n for _, _, n in scored] == [8, 8]


@pytest.mark.parametrize(("flags", "message"), [
    (["--batch_size", "2", "--chunk", "2"], "--batch_size 2 must be a multiple of --chunk 2 and larger"),
    (["--steps", "1"], "--steps must be >= 2, got 1"),
    (["--seconds_per_video", "-1"], "--seconds_per_video must be >= 0, got -1")])
def test_the_overlap_benchmark_refuses_settings_it_cannot_measure_in_one_line(flags, message):
    r = subprocess.run([sys.executable, str(ROOT / "scripts/bench_reward_overlap.py"), *flags], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {message}") and len(r.stderr.splitlines()) == 1


@pytest.mark.dist
def test_two_ranks_score_through_one_server_as_they_would_locally(server, tiny_model, tmp_path):
    """torchrun, 2 gloo ranks (dp 2, a group of 4 over both): the same launch trains with the served reward and
    with the local one; the runs agree bitwise, and the server saw both ranks' requests."""
    flags = ["--batch_size", "2", "--enable_fsdp", "False", "--reward_weights", '{"brightness":1.0,"colorfulness":0.5}']
    runs = [_args(tiny_model, tmp_path / "local", *flags, "--reward_model", f"brightness,{EXAMPLE}"),
            _args(tiny_model, tmp_path / "remote", *flags, "--reward_model", "remote", "--reward_url", server)]
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    before = httpx.get(f"{server}/health").json()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(ROOT / "tests/dist_workers/post_train_runs_worker.py"), str(spec)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "SAGE_REWARD_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    after = httpx.get(f"{server}/health").json()
    assert after["requests"] - before["requests"] == 2 * 2 * 2  # 2 ranks x 2 chunks of 1 video x 2 steps
    a, b = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("local", "remote"))
    assert len(a) == 2 and _stable(a) == _stable(b)
    wa, wb = _weights(tmp_path / "local"), _weights(tmp_path / "remote")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_score_videos_scores_through_the_server(server, tmp_path, monkeypatch):

    from sage_grpo.video import read_video, write_video

    monkeypatch.setenv("SAGE_REWARD_TOKEN", TOKEN)
    d = tmp_path / "vids"
    d.mkdir()
    write_video(d / "a.mp4", smooth_videos(1, 9, 32, 48, seed=4)[0])
    sv = load_script("score_videos")
    out = tmp_path / "t"
    assert sv.main(["--videos", str(d), "--out", str(out), "--metrics", "remote", "--reward_url", server]) == 0
    row = json.loads(out.with_suffix(".json").read_text())["videos"][0]
    frames = read_video(d / "a.mp4")[0][None]
    want = build_reward(f"brightness,{EXAMPLE}", reward_weights="")(frames, ["a"])
    assert row["brightness"] == pytest.approx(float(want["brightness"][0]), abs=1e-6)
    assert row["colorfulness"] == pytest.approx(float(want["colorfulness"][0]), abs=1e-6)
