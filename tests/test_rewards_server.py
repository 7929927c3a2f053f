"""What the reward server (scripts/serve_reward.py, a real process on 127.0.0.1) refuses: a body over its limit before
it is read, and /health answers while a large body is decoded."""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import socket
import zlib

import httpx
import pytest
from test_rewards_remote import serve

TOKEN = "0123456789abcdef" * 4  # as long as `openssl rand -hex 32`
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMIT_MB = 64


@pytest.fixture(scope="module")
def server():
    """brightness behind a token, taking request bodies up to 64 MiB."""
    with serve("--reward_model", "brightness", "--max_request_mb", str(LIMIT_MB), token=TOKEN) as (url, _):
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
    """A 65 KB body that decompresses past the limit: decompressed in a worker thread (the event loop answers
    /health meanwhile) and refused once it reaches the limit."""
    z = zlib.compressobj(9)
    bomb = b"".join([z.compress(bytes(1 << 20)) for _ in range(LIMIT_MB + 1)] + [z.flush()])
    assert len(bomb) < 100_000
    answered = 0
    with httpx.Client(timeout=20) as client, post_raw(server, {**AUTH, "Content-Length": str(len(bomb))},
                                                      [bomb]) as s:
        while not select.select([s], [], [], 0)[0]:  # until the /score answer arrives
            assert client.get(f"{server}/health").status_code == 200
            answered += 1
        status, got = answer(s)
    assert status == 413 and "decompresses to more than the server's limit" in got["detail"]
    assert answered >= 3, answered  # decoded on the event loop, /health would wait for the whole decode
