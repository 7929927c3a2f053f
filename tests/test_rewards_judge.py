"""`--reward_model vlm_judge`: a VLM judge over an OpenAI-compatible chat endpoint. The score (log-probabilities
against an independent computation, parsed numbers), the template, the request (frames, prompt, key), retries,
the concurrency limit and NaN on failure against a small OpenAI-compatible server in a thread of the test (the
paths a real server cannot be made to take); then `transformers serve` in its own process with a tiny LLaVA that
always answers 7: the frames reach the model, 2 training steps, and the server killed mid-run -> NaN -> checkpoint
-> stop."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import math
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import smooth_videos, wait_until_healthy
from openai.types.chat import ChatCompletion
from PIL import Image
from post_train_helpers import ROOT, _args, kill_before_rollout, pt
from test_rewards_remote import _free_port
from test_rewards_scripts import load_script

from sage_grpo.checkpoint import list_checkpoints
from sage_grpo.config import load_config, validate
from sage_grpo.errors import SageGRPOError
from sage_grpo.metrics import read_metrics
from sage_grpo.rewards import build_reward
from sage_grpo.rewards.judge import (
    DEFAULT_TEMPLATES,
    VLMJudge,
    load_template,
    parse_score,
    render,
    score_from_logprobs,
)
from sage_grpo.video import frames_to_uint8, read_video, write_video

MODEL = "fake-judge"


def position(token: str, p: float, top: list[tuple[str, float]]) -> dict:
    """One answer position of a chat completion's logprobs: the chosen token and its top candidates, by
    probability."""
    return {"token": token, "logprob": math.log(p), "bytes": None,
            "top_logprobs": [{"token": t, "logprob": math.log(q), "bytes": None} for t, q in top]}


def completion(text: str, logprobs: list[dict] | None = None) -> dict:
    """A chat completion as an OpenAI-compatible server sends it."""
    return {"id": "c", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text},
                         "logprobs": None if logprobs is None else {"content": logprobs}}]}


# "Score: 7", the score at the third position: 7 from " 7" and "7", 8, 3, and a candidate that is no score
SEVEN = [position("Score", 0.9, [("Score", 0.9)]), position(":", 0.99, [(":", 0.99)]),
         position(" 7", 0.5, [(" 7", 0.5), (" 8", 0.2), ("7", 0.1), (" 3", 0.1), (" maybe", 0.05)])]
SEVEN_SCORE = ((7 * 0.6 + 8 * 0.2 + 3 * 0.1) / 0.9 - 1) / 9


# ------------------------------------------------------------------------------------------------ the score


def test_the_logprob_score_is_the_expected_value_over_the_score_tokens():
    assert score_from_logprobs(ChatCompletion.model_validate(completion("Score: 7", SEVEN)).choices[0].logprobs
                               .content) == pytest.approx(SEVEN_SCORE, abs=1e-12)
    # a tokenizer that writes 10 as "1" then "0": P("1") splits by the next position's P("0")
    ten = [position("1", 0.7, [("1", 0.7), ("9", 0.2), ("5", 0.1)]), position("0", 0.9, [("0", 0.9), ("!", 0.1)])]
    want = ((1 * 0.7 * 0.1 + 10 * 0.7 * 0.9 + 9 * 0.2 + 5 * 0.1) / 1.0 - 1) / 9
    answer = ChatCompletion.model_validate(completion("10", ten))
    assert score_from_logprobs(answer.choices[0].logprobs.content) == pytest.approx(want, abs=1e-12)
    # one that has a token "10"
    answer = ChatCompletion.model_validate(completion("10", [position("10", 0.5, [("10", 0.5), ("9", 0.5)])]))
    assert score_from_logprobs(answer.choices[0].logprobs.content) == pytest.approx((9.5 - 1) / 9, abs=1e-12)
    yes = [position(" Yes", 0.6, [(" Yes", 0.6), (" No", 0.2), ("yes", 0.1), ("maybe", 0.1)])]
    answer = ChatCompletion.model_validate(completion("Yes", yes))
    assert score_from_logprobs(answer.choices[0].logprobs.content, "yes_no") == pytest.approx(0.7 / 0.9, abs=1e-12)
    nothing = ChatCompletion.model_validate(completion("good", [position("good", 0.9, [("good", 0.9)])]))
    assert score_from_logprobs(nothing.choices[0].logprobs.content) is None


def test_a_parsed_answer_is_its_first_number_in_1_to_10_or_its_first_yes_or_no():
    for text, want in (("7", 6 / 9), ("Score: 8/10", 7 / 9), ("10", 1.0), (" 1.", 0.0), ("7.5", 6.5 / 9)):
        assert parse_score(text) == pytest.approx(want, abs=1e-12), text
    for text in ("0", "11", "-3", "none", ""):
        assert math.isnan(parse_score(text)), text
    assert parse_score("Yes, it does.", "yes_no") == 1.0 and parse_score("NO", "yes_no") == 0.0
    assert math.isnan(parse_score("I know", "yes_no")) and math.isnan(parse_score("7", "yes_no"))


def test_the_template_is_rendered_and_a_bad_template_file_is_one_line(tmp_path):
    assert render("Rate {prompt} ({frames} frames) as {json: 1}", "a {frames} cat", 4) == \
        "Rate a {frames} cat (4 frames) as {json: 1}"
    assert load_template("") == DEFAULT_TEMPLATES["1-10"] and load_template("", "yes_no") == DEFAULT_TEMPLATES["yes_no"]
    assert "{prompt}" in DEFAULT_TEMPLATES["1-10"] and "1" in DEFAULT_TEMPLATES["1-10"]
    mine = tmp_path / "mine.txt"
    mine.write_text("Is {prompt} shown? yes or no")
    assert load_template(str(mine), "yes_no") == "Is {prompt} shown? yes or no"
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 {prompt}".encode("latin-1"))
    for name, match in (("missing.txt", "no such file"), ("empty.txt", "is empty"),
                        ("latin1.txt", "cannot be read .*UnicodeDecodeError")):
        with pytest.raises(SageGRPOError, match=f"--judge_template {tmp_path / name}.*{match}") as err:
            load_template(str(tmp_path / name))
        assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------ a fake server


class FakeJudge(ThreadingHTTPServer):
    """An OpenAI-compatible server in a thread of the test on 127.0.0.1: GET /v1/models lists MODEL, and POST
    /v1/chat/completions answers `text` (with `logprobs` when asked for them and set). It records each request's
    headers and body; it can refuse log-probabilities (400), fail the next `fail` requests (500, retry at once),
    answer every request with `status`, check a `key`, and take `delay` seconds per answer."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.text, self.logprobs, self.refuse_logprobs, self.fail, self.status, self.key = "7", None, False, 0, 0, ""
        self.delay, self.bodies, self.headers, self.in_flight, self.max_in_flight = 0.0, [], [], 0, 0
        self.lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):  # quiet
        pass

    def reply(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def refused(self, srv: FakeJudge) -> bool:
        if srv.key and self.headers.get("Authorization") != f"Bearer {srv.key}":
            self.reply(401, {"error": {"message": "invalid api key", "type": "auth"}})
            return True
        return False

    def do_GET(self):
        srv = self.server
        if not self.refused(srv):
            self.reply(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                         "owned_by": "test"}]})

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.bodies.append(body)
            srv.headers.append({k.lower(): v for k, v in self.headers.items()})
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
            failing = srv.fail > 0
            srv.fail -= failing
        try:
            time.sleep(srv.delay)
            if self.refused(srv):
                return
            if failing:
                self.reply(500, {"error": {"message": "overloaded"}}, {"retry-after-ms": "1"})
            elif srv.status:
                self.reply(srv.status, {"error": {"message": "at most 1 image(s) may be provided in one request"}})
            elif srv.refuse_logprobs and "logprobs" in body:
                self.reply(400, {"error": {"message": "logprobs is not supported"}})
            else:
                self.reply(200, completion(srv.text, srv.logprobs if body.get("logprobs") else None))
        finally:
            with srv.lock:
                srv.in_flight -= 1


@pytest.fixture()
def fake():
    srv = FakeJudge()
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)  # polls: a quick shutdown
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def judge(url: str, **kw) -> VLMJudge:
    return build_reward("vlm_judge", reward_weights="", judge_url=url, **kw).rewards["vlm_judge"]


def test_the_frames_and_the_prompt_travel_in_one_user_message_with_the_key(fake, monkeypatch):
    monkeypatch.setenv("SAGE_JUDGE_API_KEY", "k-judge")
    monkeypatch.setenv("OPENAI_API_KEY", "k-openai")
    fake.logprobs = SEVEN
    j = judge(fake.url, judge_frames=3, judge_template="", judge_scale="1-10")
    assert j.model == MODEL  # the one model the server lists
    videos = smooth_videos(2, 9, 16, 24, seed=1)
    prompts = ["a blue cube", "a red ball"]
    got = j(videos, prompts)["judge"]
    torch.testing.assert_close(got, torch.full((2,), SEVEN_SCORE), rtol=0, atol=1e-6)
    # [0]: the probe; the others in any order (concurrent): sorted by their text, as `prompts` are
    bodies = sorted(fake.bodies[1:], key=lambda b: b["messages"][0]["content"][-1]["text"])
    assert len(bodies) == 2 and all(h["authorization"] == "Bearer k-judge" for h in fake.headers)
    for body, video, prompt in zip(bodies, videos, prompts):
        assert (body["model"], body["temperature"], body["logprobs"], body["top_logprobs"]) == (MODEL, 0.0, True, 20)
        [message] = body["messages"]
        assert message["role"] == "user" and [p["type"] for p in message["content"]] == ["image_url"] * 3 + ["text"]
        assert message["content"][-1]["text"] == render(DEFAULT_TEMPLATES["1-10"], prompt, 3)
        for part, i in zip(message["content"][:3], (0, 4, 8)):  # evenly spaced, first and last included
            url = part["image_url"]["url"]
            assert url.startswith("data:image/png;base64,")
            png = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
            assert np.array_equal(png, frames_to_uint8(video[i : i + 1])[0])  # lossless
    monkeypatch.delenv("SAGE_JUDGE_API_KEY")
    judge(fake.url)
    assert fake.headers[-1]["authorization"] == "Bearer k-openai"


def test_the_video_part_is_an_mp4_of_the_frames(fake, tmp_path):
    j = judge(fake.url, judge_frames=5, judge_video=True, video_fps=24)
    j(smooth_videos(1, 9, 16, 24, seed=2), ["a"])
    [part, text] = fake.bodies[-1]["messages"][0]["content"]
    assert part["type"] == "video_url" and text["type"] == "text"
    mp4 = tmp_path / "sent.mp4"
    mp4.write_bytes(base64.b64decode(part["video_url"]["url"].removeprefix("data:video/mp4;base64,")))
    frames, fps = read_video(mp4)
    assert tuple(frames.shape) == (5, 3, 16, 24) and fps == pytest.approx(5 / (9 / 24), rel=1e-3)  # 9 frames at 24


def test_a_server_that_refuses_logprobs_is_asked_without_them_and_the_answer_parsed(fake):
    fake.refuse_logprobs, fake.text = True, "Score: 9"
    with pytest.warns(RuntimeWarning, match=r"refuses log-probabilities \(400"):
        j = judge(fake.url)
    assert j.logprobs is False and ["logprobs" in b for b in fake.bodies] == [True, False]
    got = j(smooth_videos(2, 5, 16, 16), ["a", "b"])["judge"]
    torch.testing.assert_close(got, torch.full((2,), 8 / 9), rtol=0, atol=1e-6)
    assert not any("logprobs" in b for b in fake.bodies[2:])


def test_failed_requests_are_retried_with_backoff_then_nan(fake):
    j = judge(fake.url, reward_retries=2)
    fake.fail = 2
    got = j(smooth_videos(1, 5, 16, 16), ["a"])["judge"]
    assert len(fake.bodies) == 1 + 3 and got.item() == pytest.approx(6 / 9)  # the probe, then 2 failures + 1 answer
    j = judge(fake.url, reward_retries=1, judge_concurrency=1)  # one at a time: video 0 gets both failures
    fake.fail, before = 2, len(fake.bodies)
    with pytest.warns(RuntimeWarning, match=r"the judge failed on 1 of 2 videos \(InternalServerError"):
        got = j(smooth_videos(2, 5, 16, 16), ["a", "b"])["judge"]
    assert len(fake.bodies) - before == 2 + 1  # video 0: 2 tries; video 1: 1
    assert math.isnan(got[0]) and got[1].item() == pytest.approx(6 / 9)
    fake.text = "I cannot tell"  # an answer without a score is NaN too
    with pytest.warns(RuntimeWarning, match="failed on 1 of 1 videos .no score in the answer 'I cannot tell'"):
        assert torch.isnan(j(smooth_videos(1, 5, 16, 16), ["a"])["judge"]).all()


def test_a_judge_slower_than_the_timeout_scores_nan(fake):
    j = judge(fake.url, reward_timeout=0.3, reward_retries=0)
    fake.delay = 1.5
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"failed on 2 of 2 videos \(APITimeoutError"):
        got = j(smooth_videos(2, 5, 16, 16), ["a", "b"])["judge"]
    assert torch.isnan(got).all() and time.monotonic() - t0 < 1.2


def test_at_most_judge_concurrency_requests_are_in_flight(fake):
    j = judge(fake.url, judge_concurrency=2)
    fake.delay = 0.3
    got = j(smooth_videos(6, 5, 16, 16), list("abcdef"))["judge"]
    assert fake.max_in_flight == 2 and torch.allclose(got, torch.full((6,), 6 / 9))


def test_score_videos_scores_saved_videos_with_the_judge(fake, tmp_path, capsys):
    """scripts/score_videos.py --metrics vlm_judge: the --judge_* flags reach the judge (a template file, 2
    frames), each video's exact prompt is in its request, and the judge's score is in the tables."""
    d = tmp_path / "vids"
    d.mkdir()
    for name, video in zip(("fox", "sea"), smooth_videos(2, 9, 16, 24, seed=6)):
        write_video(d / f"{name}.mp4", video)
        (d / f"{name}.txt").write_text(f"a {name} at dusk")
    template = tmp_path / "judge.txt"
    template.write_text("Rate {prompt} ({frames} frames) from 1 to 10.")
    fake.text = "Score: 8"
    sv = load_script("score_videos")
    out = tmp_path / "table"
    argv = ["--videos", str(d), "--out", str(out), "--device", "cpu"]
    assert sv.main([*argv, "--metrics", "vlm_judge,brightness", "--judge_url", fake.url, "--judge_template",
                    str(template), "--judge_frames", "2"]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["videos"]
    assert [r["judge"] for r in rows] == pytest.approx([7 / 9, 7 / 9], abs=1e-6)
    texts = [b["messages"][0]["content"][-1]["text"] for b in fake.bodies[1:]]  # [0]: the probe
    assert texts == ["Rate a fox at dusk (2 frames) from 1 to 10.", "Rate a sea at dusk (2 frames) from 1 to 10."]
    assert all([p["type"] for p in b["messages"][0]["content"]] == ["image_url"] * 2 + ["text"] for b in fake.bodies)
    # checked as in training, one line before anything loads
    for flags, message in ((["--metrics", "brightness", "--judge_url", fake.url], "--judge_url is only used by the "
                                                                                   "metric vlm_judge"),
                           (["--metrics", "vlm_judge"], "--metrics vlm_judge needs --judge_url"),
                           (["--metrics", "vlm_judge", "--judge_url", fake.url, "--reward_timeout", "0"],
                            "--reward_timeout must be > 0")):
        capsys.readouterr()
        assert sv.main([*argv, *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err


def test_a_judge_server_that_cannot_serve_is_one_line_before_the_policy_loads(fake, tiny_model, tmp_path,
                                                                              monkeypatch):
    monkeypatch.delenv("SAGE_JUDGE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    dead = f"http://127.0.0.1:{_free_port()}"
    fake.key = "right"
    cases = [(dead, r"judge server http://127.0.0.1:\d+ cannot be reached listing its models \(APIConnectionError"),
             (fake.url, r"refused the API key \(401\) listing its models: set SAGE_JUDGE_API_KEY \(or OPENAI_API_KEY")]
    for url, match in cases:
        with pytest.raises(SageGRPOError, match=match) as err:
            judge(url, reward_retries=0)
        assert "\n" not in str(err.value)
    monkeypatch.setenv("SAGE_JUDGE_API_KEY", "right")
    fake.status = 400  # a request like training's is refused: now, with the server's reason
    with pytest.raises(SageGRPOError, match=r"answered 400 a request with 4 frames for model 'fake-judge': .*at most "
                                            r"1 image"):
        judge(fake.url, reward_retries=0)

    def never(*a, **k):
        raise AssertionError("the policy was loaded before the judge server was checked")

    monkeypatch.setattr(pt, "load_policy", never)
    with pytest.raises(SageGRPOError, match="cannot be reached listing its models"):
        pt.main(_args(tiny_model, tmp_path, "--reward_model", "vlm_judge", "--reward_weights", '{"judge":1}',
                      "--judge_url", dead, "--reward_retries", "0"))


def test_judge_flags_are_checked_before_anything_runs(tmp_path):
    def check(*argv):
        validate(load_config(["--config", str(ROOT / "configs/tiny_cpu.yaml"), *argv]), world_size=1)

    judged = ("--reward_model", "vlm_judge", "--reward_weights", '{"judge":1}')
    url = ("--judge_url", "http://127.0.0.1:1")
    (tmp_path / "empty.txt").write_text("")
    for argv, match in (
        (judged, "vlm_judge needs --judge_url"),
        (url, "--judge_url is only used by the vlm_judge reward"),
        ((*judged, "--judge_url", "127.0.0.1:8000"), "must start with http:// or https://"),
        ((*judged, "--judge_url", "http://a:1,http://b:1"), "--judge_url takes one server"),
        ((*judged, *url, "--judge_template", str(tmp_path / "none.txt")), "--judge_template .* no such file"),
        ((*judged, *url, "--judge_template", str(tmp_path / "empty.txt")), "--judge_template .* is empty"),
        ((*judged, *url, "--judge_frames", "0"), "--judge_frames must be >= 1"),
        ((*judged, *url, "--judge_concurrency", "0"), "--judge_concurrency must be >= 1"),
        ((*judged, *url, "--judge_scale", "1-5"), "judge_scale"),
    ):
        with pytest.raises(SageGRPOError, match=match) as err:
            check(*argv)
        assert "\n" not in str(err.value)
    check(*judged, *url)  # a trained judge
    check(*url, "--validation_metrics", "auto", "vlm_judge")  # a judge for validation only


# ------------------------------------------------------------------------------------------------ transformers serve


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> Path:
    from sage_grpo.rewards.tiny import write_tiny_judge

    return write_tiny_judge(tmp_path_factory.mktemp("tiny_judge") / "judge", answer="7")


@contextlib.contextmanager
def transformers_serve(model: Path, log: Path, port: int | None = None):
    """`transformers serve MODEL` on 127.0.0.1 in its own process, offline, its output in ``log`` -> (url, process);
    killed (by its pid) on exit."""
    port = port or _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("transformers")), "serve", str(model), "--device",
                                 "cpu", "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, 180, lambda: log.read_text()[-2000:])
        yield url, proc
    finally:
        proc.kill()
        proc.wait()


def chat_requests(log: Path) -> int:
    """The chat completions a `transformers serve` log shows answered (uvicorn's access lines)."""
    return log.read_text().count('"POST /v1/chat/completions HTTP/1.1" 200')


@pytest.fixture(scope="module")
def served(judge_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with transformers_serve(judge_dir, log) as (url, _):
        yield url, log


@pytest.mark.slow
def test_transformers_serve_reads_every_frame_and_the_judge_parses_its_answer(served):
    url, _ = served
    with pytest.warns(RuntimeWarning, match="returns no log-probabilities"):  # transformers serve ignores them
        j = judge(url, judge_frames=3)
    prompt_tokens = []
    for n in (1, 3):
        answer = j.client.chat.completions.create(model=j.model, max_tokens=4, messages=j._messages(
            smooth_videos(1, n, 40, 60)[0], "a cat", 1.0))
        prompt_tokens.append(answer.usage.prompt_tokens)
        assert answer.choices[0].message.content == "7"
    assert prompt_tokens[1] - prompt_tokens[0] == 2 * 4  # 4 image tokens (2 x 2 patches of 14) per frame more
    got = j(smooth_videos(3, 9, 32, 48, seed=3), ["a", "b", "c"])["judge"]
    torch.testing.assert_close(got, torch.full((3,), 6 / 9), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_training_two_steps_with_the_judge_through_transformers_serve(served, tiny_model, tmp_path, monkeypatch):
    url, log = served
    monkeypatch.chdir(ROOT)
    before = chat_requests(log)
    pt.main(_args(tiny_model, tmp_path, "--reward_model", "vlm_judge,brightness", "--reward_weights",
                  '{"judge":1.0,"brightness":1.0}', "--judge_url", url, "--judge_frames", "2"))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and chat_requests(log) - before == 1 + 2 * 4  # the probe, then 4 videos a step
    for r in rows:
        assert r["reward/failed"] == 0 and r["reward/judge_mean"] == pytest.approx(6 / 9, abs=1e-6)
        assert r["reward/total_mean"] == pytest.approx(r["reward/brightness_mean"] + 6 / 9, abs=1e-5)


@pytest.mark.slow
def test_a_killed_judge_server_gives_nan_then_a_clean_stop_with_a_checkpoint(judge_dir, tiny_model, tmp_path,
                                                                            monkeypatch):
    flags = ["--reward_model", "vlm_judge", "--reward_weights", '{"judge":1}', "--reward_retries", "0",
             "--reward_timeout", "5", "--max_steps", "4", "--max_failed_reward_steps", "2", "--judge_frames", "2"]
    with transformers_serve(judge_dir, tmp_path / "serve.log") as (url, proc):
        kill_before_rollout(monkeypatch, proc, at=2)
        with pytest.raises(SageGRPOError, match="no finite reward in the last 2 steps .*checkpoint-3 is saved"):
            pt.main(_args(tiny_model, tmp_path / "run", *flags, "--judge_url", url))
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["reward/failed"] for r in rows] == [0, 4, 4]
    assert rows[0]["reward/judge_mean"] == pytest.approx(6 / 9, abs=1e-6)
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [3]
