"""What the reward server (scripts/serve_reward.py, a real process on 127.0.0.1) refuses: a body over its limit before
it is read, and /health answers while a large body is decoded; a batcher that stops fails /health and every
request at once, and the client goes to the next replica; other hosts are served only with a token or on purpose;
servers of one reward with other settings are not replicas. And the quiet failures a wrong client or server would
pass unseen: a refused token or a body over the limit retried with backoff, a missing score taken as 0, every rank
and call starting at the first replica, a token compared by its first bytes."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib

import httpx
import pytest
import torch
from helpers import free_port, load_script, serve, smooth_videos
from post_train_helpers import ROOT
from safetensors.torch import save as safetensors_save

from sage_grpo.errors import SageGRPOError
from sage_grpo.rewards import build_reward
from sage_grpo.rewards.remote import BodyTooLarge, RemoteReward, decode_batch, encode_batch

TOKEN = "0123456789abcdef" * 4  # as long as `openssl rand -hex 32`
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMIT_MB = 64
DYING = """
import asyncio
from sage_grpo.rewards.builtin import BrightnessReward
class Dying(BrightnessReward):
    def __call__(self, videos, prompts):
        if "die" in prompts:  # as a reward whose own asyncio client was cancelled would
            raise asyncio.CancelledError("the reward's client was cancelled")
        return super().__call__(videos, prompts)
def build(**kw):
    return Dying()
"""


@pytest.fixture(scope="module")
def dying(tmp_path_factory) -> str:
    """brightness, except that a batch with the prompt "die" raises a BaseException that is no Exception."""
    path = tmp_path_factory.mktemp("dying") / "dying.py"
    path.write_text(DYING)
    return f"{path}:build"


@pytest.fixture(scope="module")
def server(dying):
    """`dying` behind a token, taking request bodies up to 64 MiB."""
    with serve("--reward_model", dying, "--max_request_mb", str(LIMIT_MB), token=TOKEN) as (url, _):
        yield url


@pytest.fixture(scope="module")
def replica(dying):
    """A replica of `server` (the same reward and reward flags; its body limit is not one of them)."""
    with serve("--reward_model", dying, token=TOKEN) as (url, _):
        yield url


@contextlib.contextmanager
def post_raw(url: str, headers: dict, body_parts=()):
    """POST /score over a plain socket with the headers and body given (a lie about the length included) -> the
    socket, closed on exit: only the server decides when to answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(f"POST /score HTTP/1.1\r\nHost: {host}\r\n{head}\r\n".encode())
        for part in body_parts:
            s.sendall(part)
        yield s


def answer(s: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the response on ``s``."""
    r = http.client.HTTPResponse(s)
    r.begin()
    return r.status, json.loads(r.read())


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    with post_raw(server, {**AUTH, "Content-Length": str(20 * 10**9)}) as s:  # announces 20 GB, sends nothing
        status, got = answer(s)
    assert status == 413 and "larger than the server's limit of 67108864 bytes" in got["detail"]
    mib = bytes(1 << 20)
    chunk = b"%x\r\n%s\r\n" % (len(mib), mib)
    with post_raw(server, {**AUTH, "Transfer-Encoding": "chunked"}, [chunk] * (LIMIT_MB + 1)) as s:
        status, got = answer(s)  # cut off as it grows past the limit, without its last chunk
    assert status == 413 and "larger than the server's limit" in got["detail"]
    assert httpx.get(f"{server}/health").json()["requests"] == 0  # neither reached the reward


def test_health_answers_while_a_large_body_is_decoded(server):
    """A 50 MB body (of 64 MiB allowed) is inflated and decoded in a worker thread, in steps that hold the GIL
    briefly: /health, asked by a probe thread meanwhile, answers within 2 s (a 2 GiB body held it 3 to 11 s when it
    was inflated in one call and copied by safetensors). A zlib bomb is refused at its header, without inflating."""
    videos = torch.zeros(1, 16, 3, 512, 512)  # 50 MB of float32, compressed to 50 KB
    body = encode_batch(videos, ["a"])
    latencies, done = [], threading.Event()

    def probe():
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                t0 = time.monotonic()
                assert client.get(f"{server}/health").status_code == 200
                latencies.append(time.monotonic() - t0)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    try:
        r = httpx.post(f"{server}/score", content=body, headers=AUTH, timeout=60)
    finally:
        done.set()
        thread.join(timeout=60)
    assert r.status_code == 200 and r.json()["scores"]["brightness"] == [0.0]
    assert latencies and max(latencies) < 2.0, latencies
    z = zlib.compressobj(9)
    bomb = b"".join([z.compress(bytes(1 << 20)) for _ in range(LIMIT_MB // 2)] + [z.flush()])  # 32 MiB of zeros
    r = httpx.post(f"{server}/score", content=bomb, headers=AUTH)
    assert r.status_code == 400 and "malformed request body (header" in r.json()["detail"]


def test_the_decoded_size_counts_against_the_limit():
    """uint8 frames become float32 on the server, 4x their size: the decompressed bytes plus that copy must fit the
    limit, so a request holds at most its body and the limit (float frames are a view of the decompressed bytes)."""
    frames = torch.zeros(2, 4, 3, 256, 256, dtype=torch.uint8)  # 1.5 MiB, 6 MiB as float32
    body = encode_batch(frames, ["a", "b"], torch.uint8)
    with pytest.raises(BodyTooLarge, match=r"decodes to \d+ bytes \(its uint8 frames as float32\), more than the "
                                           "server's limit of 4194304 bytes"):
        decode_batch(body, 4 << 20)  # the 1.5 MiB decompressed fit
    got, prompts = decode_batch(body, 8 << 20)  # 1.5 + 6 MiB fit
    assert got.dtype == torch.float32 and got.shape == frames.shape and prompts == ["a", "b"]
    floats = encode_batch(frames.float(), ["a", "b"])  # 6 MiB decompressed: decoded as a view, nothing more
    got, _ = decode_batch(floats, 7 << 20)
    assert got.dtype == torch.float32 and not got.any()


def test_a_zlib_bomb_is_inflated_only_as_far_as_its_header_reaches():
    """Zeros that inflate to 64 MiB, alone or after a valid small request, under a 1 GiB limit: inflated in steps,
    only the header and the tensors it announces, so no more than a step is ever held (inflated whole, the body
    takes 64 MiB before any size or header check)."""
    z = zlib.compressobj(9)
    zeros = [z.compress(bytes(1 << 20)) for _ in range(64)]
    bomb = b"".join([*zeros, z.flush()])
    z = zlib.compressobj(9)
    valid = safetensors_save({"frames": torch.ones(1, 2), "prompts": torch.tensor(list(b'["a"]'), dtype=torch.uint8)})
    trailing = b"".join([z.compress(valid), *[z.compress(bytes(1 << 20)) for _ in range(64)], z.flush()])
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="malformed request body"):
            decode_batch(bomb, 1 << 30)
        frames, prompts = decode_batch(trailing, 1 << 30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert frames.tolist() == [[1.0, 1.0]] and prompts == ["a"]
    assert peak < 24 << 20, peak  # 64 MiB when inflated whole


def test_a_batcher_that_stops_fails_health_and_requests_at_once_and_the_client_goes_to_a_replica(server, dying):
    videos = smooth_videos(2, 5, 16, 16, seed=2)
    with serve("--reward_model", dying, token=TOKEN) as (url, _):
        remote = RemoteReward([url, server], token=TOKEN, rank=0, timeout=5, retries=1, backoff=0.1)
        assert [s.urls for s in remote.servers] == [[url, server]]  # replicas; rank 0 tries `url` first
        r = httpx.post(f"{url}/score", content=encode_batch(videos, ["a", "die"]), headers=AUTH)
        assert r.status_code == 503 and "batcher stopped (CancelledError" in r.json()["detail"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        t0 = time.monotonic()
        r = httpx.post(f"{url}/score", content=encode_batch(videos, ["a", "b"]), headers=AUTH)
        assert r.status_code == 503 and "batcher stopped" in r.json()["detail"]
        got = remote(videos, ["a", "b"])  # 503 from `url` at once, then scored by `server`
        assert time.monotonic() - t0 < 4  # less than the client's timeout: nothing waited for an answer
    want = build_reward("brightness", reward_weights="")(videos, ["a", "b"])
    torch.testing.assert_close(got["brightness"], want["brightness"], rtol=0, atol=1e-6)


def test_a_stopped_batcher_fails_info_so_a_client_that_starts_takes_it_for_no_replica(server, dying):
    """/info answers 503 with the reason too: a client that starts now does not take a server that scores nothing
    more for a healthy replica (every request that starts there would spend a try on it), but says so in one line."""
    with serve("--reward_model", dying, token=TOKEN) as (url, _):
        assert httpx.get(f"{url}/info", headers=AUTH).status_code == 200
        httpx.post(f"{url}/score", content=encode_batch(smooth_videos(1, 5, 16, 16), ["die"]), headers=AUTH)
        r = httpx.get(f"{url}/info", headers=AUTH)
        assert r.status_code == 503 and "batcher stopped (CancelledError" in r.json()["detail"]
        assert httpx.get(f"{url}/info").status_code == 401  # the token is still checked first
        with pytest.raises(SageGRPOError, match=rf"reward server {url} answered 503 to /info \(the reward server's "
                                                r"batcher stopped \(CancelledError: .*\); restart it .*or leave it out "
                                                "of --reward_url") as err:
            RemoteReward([server, url], token=TOKEN, retries=0)
        assert "\n" not in str(err.value)


def test_serving_other_hosts_without_a_token_is_refused_unless_on_purpose(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "SAGE_REWARD_TOKEN"}
    r = subprocess.run([sys.executable, str(ROOT / "scripts/serve_reward.py"), "--reward_model", "brightness",
                        "--host", "0.0.0.0", "--port", str(free_port())], capture_output=True, text=True, cwd=ROOT,
                       env={**env, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: --host 0.0.0.0 lets other hosts reach the reward server, but SAGE_REWARD_TOKEN "
                               "is not set") and "--allow_unauthenticated" in r.stderr
    sr = load_script("serve_reward")
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        sr.check_exposure(host, "", False)
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        with pytest.raises(SageGRPOError, match=f"--host {host} lets other hosts reach"):
            sr.check_exposure(host, "", False)
        sr.check_exposure(host, TOKEN, False)
        sr.check_exposure(host, "", True)
    # past the check (to the next refusal, before anything is bound) with the flag, or with the token
    monkeypatch.delenv("SAGE_REWARD_TOKEN", raising=False)
    cannot = "--reward_model remote cannot be served"
    with pytest.raises(SageGRPOError, match=cannot):
        sr.main(["--reward_model", "remote", "--host", "0.0.0.0", "--allow_unauthenticated"])
    monkeypatch.setenv("SAGE_REWARD_TOKEN", TOKEN)
    with pytest.raises(SageGRPOError, match=cannot):
        sr.main(["--reward_model", "remote", "--host", "0.0.0.0"])


def test_servers_of_one_reward_with_other_settings_are_not_replicas(server, dying):
    info = httpx.get(f"{server}/info", headers=AUTH).json()
    assert info["settings"]["checkpoint_step"] == -1 and info["settings"]["dtype"] == "bf16"
    with serve("--reward_model", dying, "--checkpoint_step", "5", "--dtype", "fp32", token=TOKEN) as (url, _):
        with pytest.raises(SageGRPOError, match=rf"{server} and {url} both serve 'brightness' but are not replicas "
                                                r"\(checkpoint_step -1 vs 5, dtype 'bf16' vs 'fp32'\): start replicas "
                                                "with the same reward and reward flags"):
            RemoteReward([server, url], token=TOKEN, retries=0)


def test_a_refused_token_fails_the_batch_at_once_without_retries(server):
    """A token changed mid-run cannot be fixed by retrying: one try, NaN, no 2 + 4 + 8 s of backoff."""
    remote = RemoteReward([server], token=TOKEN, retries=3, backoff=2.0)
    remote.client.headers["Authorization"] = "Bearer changed-mid-run"
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"failed 1 time\(s\) on a batch of 2 .*token refused \(401\)"):
        got = remote(smooth_videos(2, 5, 16, 16, seed=3), ["a", "b"])
    assert time.monotonic() - t0 < 1.5
    assert torch.isnan(got["brightness"]).all()


def test_a_body_over_the_limit_fails_the_batch_at_once_and_fits_in_smaller_requests(server, monkeypatch):
    """The same body is over the server's limit on every try: one try, NaN and what to change, no 2 + 4 + 8 s of
    backoff; and what it says to change works: --reward_batch_size 1 sends each video alone, within the limit."""
    remote = RemoteReward([server], token=TOKEN, retries=3, backoff=2.0)
    videos = torch.zeros(2, 3, 3, 1024, 1024)  # 75 MB, 38 MB a video: compressed to little, decompressed past 64 MiB
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"failed 1 time\(s\) on a batch of 2 .*body too large \(413: request body "
                                            r"decompresses to more than the server's limit of 67108864 bytes\); "
                                            r"lower --reward_batch_size or raise the server's --max_request_mb"):
        got = remote(videos, ["a", "b"])
    assert time.monotonic() - t0 < 2 + 4  # the first two backoffs
    assert torch.isnan(got["brightness"]).all()
    monkeypatch.setenv("SAGE_REWARD_TOKEN", TOKEN)
    before = httpx.get(f"{server}/health").json()["requests"]
    got = build_reward("remote", reward_url=server, reward_weights="", batch_size=1)(videos, ["a", "b"])
    assert got["brightness"].tolist() == [0.0, 0.0]  # black videos
    assert httpx.get(f"{server}/health").json()["requests"] - before == 2


def test_a_missing_score_is_nan_not_zero(server):
    """A video the reward could not score travels as null and must come back NaN (masked), never 0 (trained on as
    a real score)."""
    videos = smooth_videos(2, 5, 16, 16, seed=4)
    videos[1] = float("nan")  # brightness: NaN
    answer = httpx.post(f"{server}/score", content=encode_batch(videos, ["a", "b"]), headers=AUTH).json()
    assert answer["scores"]["brightness"][1] is None
    got = RemoteReward([server], token=TOKEN)(videos, ["a", "b"])["brightness"]
    want = build_reward("brightness", reward_weights="")(videos[:1], ["a"])["brightness"]
    assert torch.isnan(got[1]) and got[0] == want[0] and want[0] > 0


def test_ranks_and_calls_start_at_different_replicas(server, replica):
    def served() -> list[int]:
        return [httpx.get(f"{u}/health").json()["requests"] for u in (server, replica)]

    videos = smooth_videos(1, 5, 16, 16, seed=5)
    ranks = [RemoteReward([server, replica], token=TOKEN, rank=r) for r in (0, 1)]
    assert [s.urls for s in ranks[0].servers] == [[server, replica]]  # replicas
    before = served()
    for remote in ranks:  # each rank's first call
        remote(videos, ["a"])
    middle = served()
    assert [m - b for m, b in zip(middle, before)] == [1, 1]  # rank 0 on `server`, rank 1 on `replica`
    ranks[0](videos, ["a"])  # rank 0's second call: the next replica
    assert [a - m for a, m in zip(served(), middle)] == [0, 1]


def test_the_server_compares_the_whole_token(server):
    def status(path: str, token: str | None) -> int:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        if path == "/info":
            return httpx.get(f"{server}/info", headers=headers).status_code
        return httpx.post(f"{server}/score", headers=headers,
                          content=encode_batch(smooth_videos(1, 5, 16, 16), ["a"])).status_code

    for path in ("/info", "/score"):
        assert status(path, TOKEN) == 200
        # the last byte wrong, the first half, one byte more, none
        for wrong in (TOKEN[:-1] + "0", TOKEN[:32], TOKEN + "0", None):
            assert status(path, wrong) == 401, (path, wrong)
