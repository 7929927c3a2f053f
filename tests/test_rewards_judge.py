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
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import free_port, load_script, smooth_videos
from PIL import Image
from post_train_helpers import ROOT, _args, kill_before_rollout, pt

from sage_grpo.checkpoint import list_checkpoints
from sage_grpo.config import load_config, validate
from sage_grpo.errors import SageGRPOError
from sage_grpo.metrics import read_metrics
from sage_grpo.rewards import build_reward, build_reward_from_config
from sage_grpo.rewards.judge import (
    DEFAULT_TEMPLATES,
    MAX_ANSWER_BYTES,
    VLMJudge,
    api_key_for,
    load_template,
    read_answer,
    render,
)
from sage_grpo.video import frames_to_uint8, read_video, write_video

MODEL = "fake-judge"


def position(token: str, p: float, top: list[tuple[str, float]]) -> dict:
    """One answer position of a chat completion's logprobs: the chosen token and its top candidates, by
    probability."""
    return {"token": token, "logprob": math.log(p), "bytes": None,
            "top_logprobs": [{"token": t, "logprob": math.log(q), "bytes": None} for t, q in top]}


def completion(text: str, logprobs: list[dict] | None = None, finish_reason: str = "stop") -> dict:
    """A chat completion as an OpenAI-compatible server sends it."""
    return {"id": "c", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "finish_reason": finish_reason,
                         "message": {"role": "assistant", "content": text},
                         "logprobs": None if logprobs is None else {"content": logprobs}}]}


def split_ten(p10: float) -> list[dict]:
    """The answer of a judge that says 10 with probability ``p10`` and 9 otherwise, through a tokenizer that writes
    10 as "1" then "0" (Qwen2/2.5's): "1" holds P(10) at the first position, "0" follows it."""
    first = "1" if p10 > 0.5 else "9"
    top = sorted([("1", max(p10, 1e-12)), ("9", max(1 - p10, 1e-12))], key=lambda c: -c[1])
    answer = [position(first, max(p10, 1e-12) if first == "1" else 1 - p10, top)]
    return answer + ([position("0", 1.0, [("0", 1.0)])] if first == "1" else [])


# The judge's expected score against the score read, for the table (P(10) at the first token, "9" or "1"
# chosen): (E - 1) / 9 with E = 10 P(10) + 9 (1 - P(10)).
TEN_TABLE = (0.0, 0.2, 0.45, 0.55, 0.9)


def expected(p10: float) -> float:
    return (10 * p10 + 9 * (1 - p10) - 1) / 9


# "Score: 7", the score at the third position: 7 from " 7" and "7", 8, 3, and a candidate that is no score
SEVEN = [position("Score", 0.9, [("Score", 0.9)]), position(":", 0.99, [(":", 0.99)]),
         position(" 7", 0.5, [(" 7", 0.5), (" 8", 0.2), ("7", 0.1), (" 3", 0.1), (" maybe", 0.05)])]
SEVEN_SCORE = ((7 * 0.6 + 8 * 0.2 + 3 * 0.1) / 0.9 - 1) / 9


# ------------------------------------------------------------------------------------------------ the score


def test_the_logprob_score_is_the_expected_value_over_the_score_tokens():
    assert read_answer(completion("Score: 7", SEVEN)).score == pytest.approx(SEVEN_SCORE, abs=1e-12)
    # a tokenizer that writes 10 as "1" then "0", "1" chosen: P("1") splits by the next position's P("0")
    ten = [position("1", 0.7, [("1", 0.7), ("9", 0.2), ("5", 0.1)]), position("0", 0.9, [("0", 0.9), ("!", 0.1)])]
    want = ((1 * 0.7 * 0.1 + 10 * 0.7 * 0.9 + 9 * 0.2 + 5 * 0.1) / 1.0 - 1) / 9
    assert read_answer(completion("10", ten)).score == pytest.approx(want, abs=1e-12)
    # "9" chosen, "1" a candidate: its split is not in this answer, the prefix to continue is
    reading = read_answer(completion("Score: 9", [position("Score:", 0.9, [("Score:", 0.9)]),
                                                  position(" 9", 0.6, [(" 9", 0.6), (" 1", 0.4)])]))
    assert math.isnan(reading.score) and reading.split_prefix == "Score: 1"
    assert reading.finish(0.75) == pytest.approx(((9 * 0.6 + 10 * 0.3 + 1 * 0.1) - 1) / 9, abs=1e-12)
    assert reading.text_score == pytest.approx(8 / 9)
    # a tokenizer with a token "10": no split
    answer = completion("10", [position("10", 0.5, [("10", 0.5), ("9", 0.4), ("1", 0.1)])])
    assert read_answer(answer).score == pytest.approx((0.5 * 10 + 0.4 * 9 + 0.1 - 1) / 9, abs=1e-12)
    yes = [position(" Yes", 0.6, [(" Yes", 0.6), (" No", 0.2), ("yes", 0.1), ("maybe", 0.1)])]
    assert read_answer(completion(" Yes", yes), "yes_no").score == pytest.approx(0.7 / 0.9, abs=1e-12)
    reading = read_answer(completion("good", [position("good", 0.9, [("good", 0.9)])]))
    assert math.isnan(reading.score) and "no score" in reading.problem


@pytest.mark.parametrize("p10", TEN_TABLE)
def test_a_two_token_ten_is_read_as_ten_whichever_token_is_chosen(p10):
    """The issue's table: before, P(10) = 0.45 scored 0.489 (the "1" read as 1) where the judge means 0.939. When "1"
    is chosen the next position splits it; when "9" is, the split is what a continuation after "1" says."""
    reading = read_answer(completion("10" if p10 > 0.5 else "9", split_ten(p10)))
    score = reading.score if reading.split_prefix is None else reading.finish(1.0)
    assert reading.split_prefix in (None, "1") and (reading.split_prefix is None) == (p10 > 0.5 or p10 < 1e-3)
    assert score == pytest.approx(expected(p10), abs=1e-9)


def test_the_score_of_a_free_text_answer_is_the_labelled_number_or_the_last_one():
    for text, want in (("7", 6 / 9), ("Score: 8/10", 7 / 9), ("10", 1.0), (" 1.", 0.0), ("7.5", 6.5 / 9),
                       ("On a scale of 1 to 10, this video is a 7", 6 / 9), ("Rating (1-10): 8", 7 / 9),
                       ("score: 7. It shows 2 cats.", 6 / 9), ("I'd give it 9 out of 10.", 8 / 9),
                       ("**Score**: 4\nThe 2 dogs look fine.", 3 / 9), ("The 3 cats: 7/10", 6 / 9)):
        assert read_answer(completion(text)).score == pytest.approx(want, abs=1e-12), text
    for text in ("0", "11", "-3", "none", "", "Score: ²", "٧"):
        assert math.isnan(read_answer(completion(text)).score), text
    assert read_answer(completion("Yes, it does."), "yes_no").score == 1.0
    assert read_answer(completion("NO"), "yes_no").score == 0.0
    for text in ("I know", "7"):
        assert math.isnan(read_answer(completion(text), "yes_no").score), text
    # with log-probabilities, the score's token is the one of the labelled number, not the scale's "1"
    tokens = [position(t, 0.99, [(t, 0.99)]) for t in ("On", " a", " scale", " of", " 1", " to", " 1", "0", ",")]
    tokens += [position(" 7", 0.8, [(" 7", 0.8), (" 6", 0.2)])]
    assert read_answer(completion("", tokens)).score == pytest.approx((7 * 0.8 + 6 * 0.2 - 1) / 9, abs=1e-12)


# answers that state their scale around their score: read by the last number, each scored the scale's 10 (1.000);
# the first four are the issue's
STATED_SCALES = {
    "8 (on a scale of 1-10)": 7 / 9,
    "7 (out of 10)": 6 / 9,
    "7 on a scale of 1 to 10": 6 / 9,
    "I'd give it a 6, where 10 is best": 5 / 9,
    "7 out of a possible 10": 6 / 9,
    "I'd say 8, with 1 being the worst and 10 being the best": 7 / 9,
    "4 on a 10-point scale": 3 / 9,
    "9, where 1 = very poor and 10 = excellent": 8 / 9,
    "On a scale of 1-10.": math.nan,  # the scale and no score
}


@pytest.mark.parametrize("text", STATED_SCALES)
def test_a_number_of_the_stated_scale_is_no_score(text):
    score = read_answer(completion(text)).score
    assert (math.isnan(score) and math.isnan(STATED_SCALES[text])) or \
        score == pytest.approx(STATED_SCALES[text], abs=1e-12), (text, score)


def test_the_logprob_score_is_read_at_the_score_not_at_the_stated_scale():
    """"8 (on a scale of 1-10)" through a tokenizer that writes 10 as "1" then "0": the expected value is the one
    at the score's token, E = 0.7 * 8 + 0.2 * 7 + 0.1 * 9 = 7.9 -> 0.767. Before, the "1" of the scale's 10 was the
    score's token, split by P("0") = 0.999 after it: 0.999."""
    tokens = [position("8", 0.7, [("8", 0.7), ("7", 0.2), ("9", 0.1)])]
    tokens += [position(t, 0.999, [(t, 0.999)]) for t in (" (", "on", " a", " scale", " of", " ", "1", "-", "1", "0",
                                                          ")")]
    reading = read_answer(completion("8 (on a scale of 1-10)", tokens))
    assert reading.split_prefix is None
    assert reading.score == pytest.approx((7.9 - 1) / 9, abs=1e-12)


CUT = "On a scale of 1 to 10, I would rate this video a solid score of"  # 16 tokens, cut before the score


def test_a_cut_off_answer_is_nan_with_its_reason():
    """Read by the last-number rule, the scale's 10 was the score (0.99 for every video), silently."""
    for answer in (completion(CUT, finish_reason="length"),
                   completion("", [position(t, 0.9, [(t, 0.9)]) for t in CUT.split(" ")], finish_reason="length")):
        reading = read_answer(answer)
        assert math.isnan(reading.score) and reading.cut_off and reading.split_prefix is None
        assert "cut off at its token budget (finish_reason 'length'; --judge_max_tokens)" in reading.problem
    assert read_answer(completion(CUT + " 9")).score == pytest.approx(8 / 9)  # the same words, ended: its score


def test_the_score_is_read_in_the_answer_after_a_reasoning_block():
    think = "The prompt asks for 2 cats; I see 2. On a scale of 1 to 10 this is clearly a 10, maybe 9."
    for text in (f"<think>{think}</think>\n\n7", f"{think}</think>7"):  # a chat template may open the block itself
        assert read_answer(completion(text)).score == pytest.approx(6 / 9, abs=1e-12), text
    reading = read_answer(completion(f"<think>{think}"))  # the answer never came
    assert math.isnan(reading.score) and "a reasoning block with no answer after it" in reading.problem
    reading = read_answer(completion(f"<think>{think}</think> I cannot tell."))
    assert math.isnan(reading.score) and "no score in the answer ' I cannot tell.'" in reading.problem
    # with log-probabilities: the score's token is the answer's, not one of the reasoning
    tokens = [position(t, 0.9, [(t, 0.9), (" 3", 0.1)]) for t in ("<think>", "a", " 10", " or", " 9", "</think>")]
    tokens += [position(" 7", 0.8, [(" 7", 0.8), (" 6", 0.2)])]
    assert read_answer(completion("", tokens)).score == pytest.approx((7 * 0.8 + 6 * 0.2 - 1) / 9, abs=1e-12)


def test_the_answer_is_the_one_after_the_last_reasoning_block():
    """A judge that answers, thinks again and answers anew: its answer is the one after the last "</think>"; read
    after the first, the first answer's label (3) would be the score."""
    again = "Score: 3\n<think>No: the blur is the cat's motion, its outline is sharp.</think>Score: 8"
    for text in (f"<think>The cat is blurred.</think>{again}", f"The cat is blurred.</think>{again}"):
        assert read_answer(completion(text)).score == pytest.approx(7 / 9, abs=1e-12), text


def test_a_score_that_shares_its_token_with_punctuation_is_read_from_the_text():
    """"9." or "Yes." chosen as one token: the candidates that are scores on their own are its minor rivals (before:
    the score was their mean, 0.159 where the answer says 9)."""
    nine = [position("9.", 0.95, [("9.", 0.95), ("2", 0.03), ("1", 0.01), ("8", 0.01)])]
    reading = read_answer(completion("9.", nine))
    assert reading.score == pytest.approx(8 / 9, abs=1e-12) and reading.split_prefix is None
    yes = [position("Yes.", 0.9, [("Yes.", 0.9), ("No", 0.08), ("yes", 0.02)])]
    assert read_answer(completion("Yes.", yes), "yes_no").score == 1.0
    labelled = [position("Score", 0.9, [("Score", 0.9)]), position(": 8", 0.9, [(": 8", 0.9), (" 3", 0.1)])]
    assert read_answer(completion("", labelled)).score == pytest.approx(7 / 9, abs=1e-12)


BAD_ANSWERS = {
    "no choices": {"choices": []},
    "choices not a list": {"choices": {"0": 1}},
    "a choice that is not an object": {"choices": [7]},
    "no message": {"choices": [{"index": 0}]},
    "content not text": {"choices": [{"message": {"content": 7}}]},
    "not an object": [1, 2],
    "a token that is no digit": completion("²", [position("²", 0.9, [("²", 0.9), ("³", 0.1)])]),
    "tokens that are not strings": completion("", [{"token": None, "logprob": 0.0, "top_logprobs": None}]),
}


@pytest.mark.parametrize("name", BAD_ANSWERS)
def test_no_answer_can_raise_and_each_unusable_one_is_nan(name):
    reading = read_answer(BAD_ANSWERS[name])
    assert math.isnan(reading.score) and reading.problem and reading.split_prefix is None, name


def test_candidates_that_are_no_score_or_have_no_probability_are_left_out():
    weird = [position("7", 0.5, [("7", 0.5), ("²", 0.3), ("8", 0.2)])]
    weird[0]["top_logprobs"].append({"token": "9", "logprob": float("-inf")})
    weird[0]["top_logprobs"].append({"token": "3", "logprob": 1e-9})  # above 0 by rounding: probability 1
    assert read_answer(completion("7", weird)).score == pytest.approx(((7 * 0.5 + 8 * 0.2 + 3) / 1.7 - 1) / 9,
                                                                      abs=1e-9)
    # "0" is no score (not 0 of a scale from 1): it is left out, not counted as a 0
    zero = [position("7", 0.6, [("7", 0.6), ("0", 0.4)])]
    assert read_answer(completion("7", zero)).score == pytest.approx(6 / 9, abs=1e-12)
    # no usable probability at the score's token: the text is what is known
    garbage = [{"token": "7", "logprob": "x", "top_logprobs": [{"token": "8", "logprob": float("nan")}]}]
    assert read_answer(completion("", garbage)).score == pytest.approx(6 / 9, abs=1e-12)


# ------------------------------------------------------------------------------------------------ the key


def test_a_key_goes_only_where_the_user_pointed_it():
    both = {"SAGE_JUDGE_API_KEY": "k-judge", "OPENAI_API_KEY": "k-openai"}
    openai_only = {"OPENAI_API_KEY": "k-openai"}
    for url, env, allow, want in (
        ("https://judge.example.com", both, False, "k-judge"),
        ("http://127.0.0.1:8000", both, False, "k-judge"),
        ("http://localhost:8000/v1", both, False, "k-judge"),
        ("http://[::1]:8000", both, False, "k-judge"),
        ("http://127.0.0.2:8000", both, False, "k-judge"),  # 127.0.0.0/8
        ("http://LOCALHOST:8000", both, False, "k-judge"),
        # names that DNS resolves: not this machine by their spelling, however they look
        ("http://judge.localhost:8000", both, False, ""),
        ("http://judge.local:8000", both, False, ""),
        ("http://localhost.example.com:8000", both, False, ""),
        ("http://127.0.0.1.nip.io:8000", both, False, ""),
        ("http://localhost.localdomain:8000", both, False, ""),
        ("http://judge.example.com:8000", both, False, ""),  # plain http to another host: withheld
        ("http://10.0.0.5:8000", both, False, ""),
        ("http://judge.example.com:8000", both, True, "k-judge"),
        ("https://api.openai.com/v1", both, False, "k-judge"),  # the user's choice for this judge wins
        ("https://api.openai.com/v1", openai_only, False, "k-openai"),
        ("http://api.openai.com/v1", openai_only, False, ""),
        ("https://api.openai.com.evil.example/v1", openai_only, False, ""),
        ("https://judge.example.com", openai_only, False, ""),
        ("http://127.0.0.1:8000", openai_only, False, ""),
        ("http://127.0.0.1:8000", {}, False, ""),
    ):
        key, why = api_key_for(url, env, allow)
        assert key == want, (url, env, allow)
        assert bool(why) == (not key and bool(env)), (url, why)
        assert "k-judge" not in why and "k-openai" not in why


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
    """An OpenAI-compatible server in a thread of the test: GET /v1/models lists MODEL, and POST
    /v1/chat/completions answers `text` (with `logprobs` when asked for them and set; a request continuing an
    assistant message gets `after` as its logprobs). It records each request's headers and body; it can refuse
    log-probabilities (400) or continuations (400), answer a continuation as a new turn (`ignore_continue`: the
    answer again, as a server that ignores continue_final_message does), cut an answer longer than the request's
    max_tokens (`tokens`: the answer's length in tokens, one character each; finish_reason "length"), fail the next
    `fail` requests (500, retry at once), answer every request with `status`, check a `key`, take `delay` seconds per
    answer, answer `raw` bytes instead (with or without a Content-Length), trickle its answer a byte every `trickle`
    seconds, or its headers too (`head_trickle`), and list `model`. ``host`` "0.0.0.0" takes requests on every
    address of this machine."""

    daemon_threads = True

    def __init__(self, host: str = "127.0.0.1"):
        super().__init__((host, 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.text, self.logprobs, self.refuse_logprobs, self.fail, self.status, self.key = "7", None, False, 0, 0, ""
        self.after, self.refuse_continue, self.raw, self.raw_length, self.trickle = None, False, None, True, 0.0
        self.ignore_continue, self.tokens, self.head_trickle, self.model = False, 0, 0.0, MODEL
        self.delay, self.bodies, self.headers, self.in_flight, self.max_in_flight = 0.0, [], [], 0, 0
        self.lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):  # quiet
        pass

    def send(self, status: int, data: bytes, length: bool = True, trickle: float = 0.0, head: float = 0.0) -> None:
        if head:  # the status line and headers a byte at a time too, then the body
            # "Connection: close": this handler speaks HTTP/1.0 and closes after each answer (see send_response)
            raw = (f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                   "Connection: close\r\n\r\n").encode() + data
            with contextlib.suppress(ConnectionError):  # the client gave up
                for i in range(len(raw)):
                    self.wfile.write(raw[i:i + 1])
                    time.sleep(head)
            return
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if length:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not trickle:
            self.wfile.write(data)
            return
        for i in range(len(data)):
            self.wfile.write(data[i:i + 1])
            self.wfile.flush()
            time.sleep(trickle)

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
        with srv.lock:
            srv.headers.append({k.lower(): v for k, v in self.headers.items()})
        if not self.refused(srv):
            self.reply(200, {"object": "list", "data": [{"id": srv.model, "object": "model", "created": 0,
                                                         "owned_by": "test"}]})

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        continuing = body["messages"][-1]["role"] == "assistant"
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
            elif continuing and srv.ignore_continue:  # a new turn: the answer to the request without the prefix
                self.reply(200, completion(srv.text, srv.logprobs))
            elif continuing and (srv.refuse_continue or not body.get("continue_final_message")):
                self.reply(400, {"error": {"message": "continue_final_message is not supported"}})
            elif continuing:
                self.reply(200, completion("0", srv.after or [position("0", 1.0, [("0", 1.0)])]))
            elif srv.raw is not None:
                self.send(200, srv.raw, srv.raw_length, srv.trickle, srv.head_trickle)
            elif srv.tokens > body["max_tokens"]:
                self.reply(200, completion(srv.text[:body["max_tokens"]], finish_reason="length"))
            else:
                answer = completion(srv.text, srv.logprobs if body.get("logprobs") else None)
                self.send(200, json.dumps(answer).encode(), trickle=srv.trickle, head=srv.head_trickle)
        finally:
            with srv.lock:
                srv.in_flight -= 1


@contextlib.contextmanager
def fake_judge(host: str = "127.0.0.1"):
    srv = FakeJudge(host)
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)  # polls: a quick shutdown
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture()
def fake():
    with fake_judge() as srv:
        yield srv


def judge(url: str, **kw) -> VLMJudge:
    return build_reward("vlm_judge", reward_weights="", judge_url=url, **kw).rewards["vlm_judge"]


def chats(srv: FakeJudge) -> list[dict]:
    """The chat requests the server got that are not continuations (the probe's included)."""
    return [b for b in srv.bodies if b["messages"][-1]["role"] != "assistant"]


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
    bodies = sorted(chats(fake)[1:], key=lambda b: b["messages"][0]["content"][-1]["text"])
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
    # OpenAI's key is OpenAI's: a judge on this machine gets none (the client's placeholder)
    monkeypatch.delenv("SAGE_JUDGE_API_KEY")
    before = len(fake.headers)
    with pytest.warns(RuntimeWarning, match="OPENAI_API_KEY is sent only to https://api.openai.com"):
        judge(fake.url)
    assert len(fake.headers) > before and all(h["authorization"] == "Bearer EMPTY" for h in fake.headers[before:])


def local_address() -> str:
    """This machine's address on its network (not loopback): the route's source address, found without sending."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # a UDP connect only picks the route; nothing is sent
        address = s.getsockname()[0]
    assert not address.startswith("127."), address
    return address


def test_plain_http_to_another_host_gets_no_key_unless_the_user_allows_it(monkeypatch):
    """The judge reached at this machine's network address over http: not loopback, so the key stays home (the
    request stays on this machine: the address is its own)."""
    monkeypatch.setenv("SAGE_JUDGE_API_KEY", "k-judge")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with fake_judge("0.0.0.0") as srv:
        url = f"http://{local_address()}:{srv.server_address[1]}"
        with pytest.warns(RuntimeWarning, match="SAGE_JUDGE_API_KEY is not sent over plain http to .*"
                                                "--judge_allow_http_key"):
            judge(url)
        assert srv.headers and all(h["authorization"] == "Bearer EMPTY" for h in srv.headers)
        before = len(srv.headers)
        judge(url, judge_allow_http_key=True)
        assert all(h["authorization"] == "Bearer k-judge" for h in srv.headers[before:])
        # the training flags reach the judge as post_train builds it
        cfg = load_config(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--reward_model", "vlm_judge",
                           "--reward_weights", '{"judge":1}', "--judge_url", url, "--judge_allow_http_key",
                           "--judge_max_tokens", "40"])
        before = len(srv.headers)
        assert build_reward_from_config(cfg).rewards["vlm_judge"].max_tokens == 40
        assert all(h["authorization"] == "Bearer k-judge" for h in srv.headers[before:])
        assert srv.bodies[-1]["max_tokens"] == 40
        srv.key = "k-judge"  # a server that needs the key says why it did not get it
        with pytest.raises(SageGRPOError, match="refused the API key .401. listing its models: SAGE_JUDGE_API_KEY is "
                                                "not sent over plain http") as err:
            judge(url, reward_retries=0)
        assert "k-judge" not in str(err.value)


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


@pytest.mark.parametrize("p10", TEN_TABLE)
def test_a_two_token_ten_through_a_server_asks_for_the_split_after_1(fake, p10):
    fake.text, fake.logprobs = ("10" if p10 > 0.5 else "9"), split_ten(p10)
    fake.after = [position("0", 0.98, [("0", 0.98), (".", 0.02)])]  # the judge's P("0") after "1"
    j = judge(fake.url)
    assert j.continues
    got = j(smooth_videos(1, 5, 16, 16), ["a"])["judge"].item()
    p0 = 0.98 if 1e-3 < p10 < 0.5 else 1.0  # "1" chosen: its "0" follows, chosen
    want = (10 * p10 * p0 + 1 * p10 * (1 - p0) + 9 * (1 - p10) - 1) / 9
    assert got == pytest.approx(want, abs=1e-6)
    cont = [b for b in fake.bodies[2:] if b["messages"][-1]["role"] == "assistant"]
    assert len(cont) == (1 if 1e-3 < p10 < 0.5 else 0)
    for b in cont:  # the same request, the answer so far continued, one token
        assert b["messages"][-1] == {"role": "assistant", "content": "1"} and b["max_tokens"] == 1
        assert b["continue_final_message"] is True and b["add_generation_prompt"] is False
        assert b["messages"][:-1] == fake.bodies[-2]["messages"]


def test_a_server_that_cannot_continue_an_answer_gives_the_answers_text(fake):
    fake.text, fake.logprobs, fake.refuse_continue = "9", split_ten(0.3), True
    with pytest.warns(RuntimeWarning, match="cannot continue an answer .*continue_final_message is not supported"):
        j = judge(fake.url)
    assert not j.continues
    assert j(smooth_videos(1, 5, 16, 16), ["a"])["judge"].item() == pytest.approx(8 / 9, abs=1e-6)


# a judge that says 9 (0.7), 8 (0.2) or 10 (0.1, written "1" "0"): E = 8.9, the score 7.9 / 9 = 0.878
NINE = [position("9", 0.7, [("9", 0.7), ("8", 0.2), ("1", 0.1)])]
SCORE_NINE = [position("Score", 0.99, [("Score", 0.99)]), position(":", 0.99, [(":", 0.99)]),
              position(" 9", 0.7, [(" 9", 0.7), (" 8", 0.2), (" 1", 0.1)])]


@pytest.mark.parametrize("text, logprobs", [("9", NINE), ("Score: 9", SCORE_NINE)])
def test_a_server_that_answers_a_continuation_as_a_new_turn_gives_the_answers_text(fake, text, logprobs):
    """A server that ignores continue_final_message answers the request again: its first position holds no "0", so
    the "1" was read as 1 (0.778 where the judge means 0.878). The start-up check, or the first video that needs the
    split, finds the answer starting anew (a score, or the answer's own first token): one warning, the text."""
    fake.text, fake.logprobs = text, logprobs
    want = (0.7 * 9 + 0.2 * 8 + 0.1 * 10 - 1) / 9
    assert judge(fake.url)(smooth_videos(1, 5, 16, 16), ["a"])["judge"].item() == pytest.approx(want, abs=1e-6)
    fake.ignore_continue = True
    with pytest.warns(RuntimeWarning, match="cannot continue an answer .it answers a new turn instead, ignoring "
                                            "continue_final_message"):
        j = judge(fake.url)
    assert not j.continues
    got = j(smooth_videos(1, 5, 16, 16), ["a"])["judge"].item()
    assert got == pytest.approx(8 / 9, abs=1e-6) and abs(got - want) < 0.02
    fake.ignore_continue = False  # found while scoring (the start-up check saw a server that continued)
    j = judge(fake.url)
    assert j.continues
    fake.ignore_continue = True
    with pytest.warns(RuntimeWarning, match="it answers a new turn instead") as caught:
        got = j(smooth_videos(2, 5, 16, 16), ["a", "b"])["judge"]
    assert not j.continues and len([w for w in caught if "new turn" in str(w.message)]) == 1
    torch.testing.assert_close(got, torch.full((2,), 8 / 9), rtol=0, atol=1e-6)


def test_a_cut_off_answer_stops_the_start_up_check_with_the_flag_that_fixes_it(fake):
    """A reasoning judge thinks before it answers: 16 tokens cut every answer, and the last number of the reasoning
    was the score. The start-up check says so in one line; with room, the score is the answer's after the
    reasoning."""
    fake.text = "<think>" + "The cat is blurry; 10 would be too much. " * 8 + "</think>\n7"
    fake.tokens = len(fake.text)  # a character a token: cut by any budget below its length
    with pytest.raises(SageGRPOError, match="the answer to a test request was cut off at --judge_max_tokens 16 "
                                            r"before its end \(finish_reason 'length'\), so every score would be "
                                            "NaN: raise --judge_max_tokens") as err:
        judge(fake.url)
    assert "\n" not in str(err.value)
    j = judge(fake.url, judge_max_tokens=1024)
    assert j(smooth_videos(1, 5, 16, 16), ["a"])["judge"].item() == pytest.approx(6 / 9, abs=1e-6)
    assert {b["max_tokens"] for b in chats(fake)[-2:]} == {1024}
    fake.tokens = 2000  # answers longer than the budget while training: NaN, with the reason
    with pytest.warns(RuntimeWarning, match="failed on 1 of 1 videos .*cut off at its token budget"):
        assert math.isnan(j(smooth_videos(1, 5, 16, 16), ["a"])["judge"].item())


@pytest.mark.parametrize("head, every", [(True, 0.25), (False, 0.9)])
def test_a_request_ends_at_the_timeout_however_slowly_its_headers_or_body_come(fake, head, every):
    """httpx's timeout bounds each read: headers a byte every 0.25 s held a 1-second request for their whole length,
    and body bytes just under the timeout apart let a body run to twice it. The whole try ends at the timeout."""
    j = judge(fake.url, reward_timeout=1.0, reward_retries=0)
    fake.trickle, fake.head_trickle = every, (every if head else 0.0)
    t0 = time.monotonic()
    match = "APITimeoutError" if head else "AnswerError: an answer still coming 1 s"
    with pytest.warns(RuntimeWarning, match=f"failed on 1 of 1 videos .{match}"):
        got = j(smooth_videos(1, 5, 16, 16), ["a"])["judge"]
    assert math.isnan(got.item()) and time.monotonic() - t0 < 1.5


def test_a_trickling_answer_ends_at_the_timeout(fake):
    j = judge(fake.url, reward_timeout=1.0, reward_retries=0)
    fake.trickle = 0.02  # a byte every 20 ms: each read is quick, the answer takes seconds
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"failed on 1 of 1 videos \(AnswerError: an answer still coming 1 s"):
        got = j(smooth_videos(1, 5, 16, 16), ["a"])["judge"]
    assert math.isnan(got.item()) and time.monotonic() - t0 < 2.5  # before: ~1 s per 50 bytes of a 250-byte body


@pytest.mark.parametrize("length", [True, False])
def test_an_answer_over_the_size_cap_is_nan(fake, length):
    j = judge(fake.url, reward_retries=0)
    fake.raw, fake.raw_length = b'{"choices": [], "pad": "' + b"x" * MAX_ANSWER_BYTES + b'"}', length
    with pytest.warns(RuntimeWarning, match="AnswerError: an answer (of more than|of [0-9,]+ bytes .more than) "
                                            "1,048,576"):
        assert math.isnan(j(smooth_videos(1, 5, 16, 16), ["a"])["judge"].item())


@pytest.mark.parametrize("raw, match", [
    (b'{"error": {"message": "CUDA out of memory while judging"}}', "the server answered an error: CUDA out of "
                                                                    "memory while judging"),
    (b'{"error": "model is loading"}', "the server answered an error: model is loading"),
    (b'{"choices": []}', "no choices"),
    (b"<html>Bad gateway</html>", "not JSON: b'<html>Bad gateway"),
    (b"[1, 2]", "not a JSON object"),
    (json.dumps(completion("Score: ²")).encode(), "no score in the answer"),
])
def test_every_unusable_answer_is_nan_with_its_reason(fake, raw, match):
    j = judge(fake.url, reward_retries=0)
    fake.raw = raw
    with pytest.warns(RuntimeWarning, match=f"failed on 1 of 1 videos .*{match}"):
        assert math.isnan(j(smooth_videos(1, 5, 16, 16), ["a"])["judge"].item())


def test_an_unusable_answer_to_the_probe_is_one_line_or_one_warning(fake):
    fake.raw = b'{"error": {"message": "the model is still loading"}}'
    with pytest.raises(SageGRPOError, match="a request with 4 frames for model 'fake-judge': the server answered an "
                                            "error: the model is still loading") as err:
        judge(fake.url, reward_retries=0)
    assert "\n" not in str(err.value)
    fake.raw = None
    fake.text, fake.logprobs = "²", [position("²", 0.9, [("²", 0.9), ("³", 0.1)])]
    with pytest.warns(RuntimeWarning, match="answer to a test request has no score in the answer '²'"):
        judge(fake.url)


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
    dead = f"http://127.0.0.1:{free_port()}"
    fake.key = "right"
    cases = [(dead, r"judge server http://127.0.0.1:\d+ cannot be reached listing its models \(APIConnectionError"),
             (fake.url, r"refused the API key \(401\) listing its models: set SAGE_JUDGE_API_KEY to its key")]
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


# httpx absent, as Python reports an absent package: every import of it (or of a module under it) fails. That is
# what `pip install 'sage-grpo[judge]'` left before the extra named httpx (openai 3 and huggingface_hub 2 depend on
# httpx2); post_train.py runs as a user runs it, in a process of its own
WITHOUT_HTTPX = """
import runpy, sys

class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "httpx":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Absent())
sys.argv = ["post_train.py", *sys.argv[1:]]
runpy.run_path("post_train.py", run_name="__main__")
"""


@pytest.mark.parametrize("flags", [("--reward_model", "vlm_judge", "--reward_weights", '{"judge":1}'),
                                   pytest.param(("--validation_metrics", "auto", "vlm_judge", "--validation_interval",
                                                 "1"), marks=pytest.mark.slow)],
                         ids=["trained", "validation-only"])
def test_a_judge_without_httpx_is_one_line_before_the_run_folder_is_made(tiny_model, tmp_path, flags):
    """Before, the judge died in setup with a ModuleNotFoundError traceback (a judge for validation only: after the
    policy had loaded), the run folder made."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", WITHOUT_HTTPX, *_args(tiny_model, out, *flags, "--judge_url",
                                                                    "http://127.0.0.1:1")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    # the error is one line (a library's import warnings may come before it)
    assert "Traceback" not in r.stderr and r.stderr.splitlines()[-1:] == [
        "error: the vlm_judge reward needs the openai and httpx packages (No module named 'httpx'): pip install "
        "'sage-grpo[judge]'"], r.stderr[-2000:]
    assert not out.exists()


@pytest.mark.slow
def test_a_resume_against_a_server_of_another_model_is_named(fake, tiny_model, tmp_path, capsys):
    """--judge_model "" takes the model the server lists: the checkpoint records it, and a resume against a server
    that lists another is not reported exact."""
    flags = ["--reward_model", "vlm_judge", "--reward_weights", '{"judge":1}', "--judge_url", fake.url,
             "--judge_frames", "2", "--save_interval", "1"]
    pt.main(_args(tiny_model, tmp_path, *flags, "--max_steps", "1"))
    state = json.loads((list_checkpoints(tmp_path)[-1][1] / "train_state.json").read_text())
    assert state["resolved"] == {"reward.judge_model": MODEL}
    capsys.readouterr()
    fake.model = "another-judge"
    pt.main(_args(tiny_model, tmp_path, *flags, "--max_steps", "2", "--resume_from_checkpoint", "latest"))
    assert "reward.judge_model: '' -> '' (used: 'fake-judge' -> 'another-judge')" in capsys.readouterr().out


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
        ((*judged, *url, "--judge_max_tokens", "0"), "--judge_max_tokens must be >= 1"),
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


# `transformers serve` in its own process (offline, its output in a log) and the chat completions its log shows
# answered: scripts/bench_judge_learning.py's, which trains through it
_bench = load_script("bench_judge_learning")
transformers_serve, chat_requests = _bench.serve, _bench.chat_requests


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
