"""A VLM judge over an OpenAI-compatible chat endpoint: ``--reward_model vlm_judge --judge_url http://host:port``.

Any server of the OpenAI chat API serves it (vLLM, SGLang, ``transformers serve``). For each video, one request to
``<judge_url>/v1/chat/completions`` holds one user message: ``--judge_frames`` evenly spaced frames as base64 PNG
``image_url`` parts (or, with ``--judge_video``, one mp4 ``video_url`` part), then the judging template with the
video's prompt in it. The client is the ``openai`` package (its retries with exponential backoff on connection
errors, 408, 409, 429 and 5xx; never on a refused key) over `deadline_client`, so that one try of a request ends
``--reward_timeout`` seconds after it was sent however slowly the server writes its headers or body; the answer's
body is read here, and an answer over ``max_answer_bytes`` (`MAX_ANSWER_BYTES`, more for a long
``--judge_max_tokens``) is cut off.

The API key goes only where the user pointed it (`api_key_for`): ``SAGE_JUDGE_API_KEY`` to the judge server, over
https or to this machine by its spelling (``localhost``, a literal loopback address; plain http to another host only
with ``--judge_allow_http_key``); ``OPENAI_API_KEY`` only to https://api.openai.com, never to another server.

The score, in [0, 1] (component ``judge``), is read at the answer's score, in the answer after the last reasoning
block (``<think>...</think>``): the labelled number ("Score: 7", "Rating (1-10): 8", "7/10", "7 out of 10"), else the
answer's last number, a number of a stated scale never (so "On a scale of 1 to 10, 7", "7 (out of 10)" and "7, where
10 is best" are 7), or the first "yes" / "no" for ``--judge_scale yes_no``.
An answer cut off at ``--judge_max_tokens`` (``finish_reason`` "length") has no score: its last number is whatever
came last. The score is read

* from the token log-probabilities where the server returns them (asked with ``logprobs`` and ``top_logprobs``): at
  the token of that score, when that token is the score alone ("9." as one token is read from the text), the
  expected value E over "1".."10" among the returned candidates, renormalised, as (E - 1) / 9; or P(yes) /
  (P(yes) + P(no)). A tokenizer that writes 10 as "1" then "0" (Qwen2/2.5, Llama 2, the
  byte tokenizers) gives the candidate "1" the probability of 1 and of 10 together; the share of 10 is P("0") after
  that "1": read at the next position when "1" was chosen, else by a second request that continues the answer after
  "1" (vLLM's and SGLang's ``continue_final_message``) and reads its first position. A server that cannot continue an
  answer (it refuses the field, or answers a new turn) gives, for such a video, the score of the answer's text
  instead (one warning);
* else from the answer's text: the number n in [1, 10] as (n - 1) / 9 (another number is NaN), or "yes" / "no" as
  1 / 0.

A server that refuses the log-probability fields (a 400 or 422 that a request without them does not get) is asked
without them from then on. A request that still fails after the retries, an answer with no score, an answer that
cannot be read (an error body, no choices, not JSON, too large, too slow) is NaN, with one warning per call naming
the last reason (the server's own message for an error body), as for the other remote rewards, so the failed-reward
policy (``--max_failed_reward_steps``) applies. When the reward is built, the server's model list and one request
like the ones training sends (gray frames) are checked, so a server that cannot be reached, refuses the key,
refuses such a request or cuts its answer off at ``--judge_max_tokens`` is one error line before the policy loads.
"""

from __future__ import annotations

import base64
import importlib
import io
import ipaddress
import json
import math
import os
import re
import tempfile
import threading
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import torch

from sage_grpo.config import JUDGE_SCALES, VIDEO_FPS, RewardConfig, check_judge_url, read_judge_template
from sage_grpo.errors import SageGRPOError
from sage_grpo.rewards.base import _one_line, register_reward
from sage_grpo.rewards.remote import apply_read, deadline_client

__all__ = ["DEFAULT_TEMPLATES", "JUDGE_KEY_ENV", "MAX_ANSWER_BYTES", "OPENAI_KEY_ENV", "Reading", "VLMJudge",
           "api_key_for", "check_installed", "load_template", "read_answer", "render", "score_span"]

JUDGE_KEY_ENV = "SAGE_JUDGE_API_KEY"  # the judge server's key: sent to --judge_url
OPENAI_KEY_ENV = "OPENAI_API_KEY"  # OpenAI's key: sent to OpenAI's API only
OPENAI_HOST = "api.openai.com"
TOP_LOGPROBS = 20  # the most that OpenAI's API and vLLM's default --max-logprobs return
# an answer of 16 positions with TOP_LOGPROBS candidates each is a few tens of kB; anything near a MiB is not a short
# judge's answer, and reading it whole (answers of 200 MiB were seen to take the client past 1 GiB) is not safe. A
# longer --judge_max_tokens (a reasoning judge) allows POSITION_BYTES per token: a position of 20 candidates is about
# 1.5 kB of JSON, more with the candidates' "bytes" lists
MAX_ANSWER_BYTES = 1 << 20
POSITION_BYTES = 4 << 10
# the share of the candidate "1" below which its split between 1 and a two-token 10 is not asked for: the score
# moves by at most this much (E by at most 9 times it)
SPLIT_MIN = 1e-3
PROBE_SIZE = 64  # side of the gray frames of the request checked when the reward is built
_DEFAULTS = RewardConfig()

DEFAULT_TEMPLATES = {
    "1-10": (
        "You are an expert judge of AI-generated videos. The {frames} images are frames of one video, in order, "
        "generated from this prompt:\n"
        '"{prompt}"\n\n'
        "Rate the video from 1 (very poor) to 10 (excellent), judging together:\n"
        "- how faithfully it shows what the prompt asks for (subjects, attributes, actions, setting, style);\n"
        "- its visual quality (sharp, natural exposure and colour, no artifacts, distortions or broken anatomy);\n"
        "- its motion across the frames (smooth, physically plausible, objects keep their identity).\n"
        "Answer with the number only."
    ),
    "yes_no": (
        "You are an expert judge of AI-generated videos. The {frames} images are frames of one video, in order, "
        "generated from this prompt:\n"
        '"{prompt}"\n\n'
        "Does the video faithfully show what the prompt asks for, with good visual quality and natural motion? "
        "Answer yes or no only."
    ),
}
_PLACEHOLDER = re.compile(r"\{(prompt|frames)\}")
_NUM = r"(?<![0-9.])(-?[0-9]+(?:\.[0-9]+)?)"  # ASCII digits only: "²" or "٧" is no score; "-3" is -3, no score
# "7/10", "7 / 10", "7 out of 10": the number before the scale's top
_OUT_OF = re.compile(_NUM + r"\s*(?:/|out\s+of)\s*10(?![0-9])", re.IGNORECASE)
# "Score: 7", "rating = 8", "Rating (1-10): 8", "**Score**: 9": a label, then anything but a colon or line break,
# then ":" or "=", then the number
_LABELLED = re.compile(r"\b(?:score|rating|grade)\b[^:=\n]{0,40}[:=][\s*]*" + _NUM, re.IGNORECASE)
_ANY = re.compile(_NUM)
# where the answer states its scale, the numbers of that statement are the scale's, no score: "8 (on a scale of 1-10)",
# "7 (out of 10)", "a 6, where 10 is best", "on a 10-point scale". Read by the last number, each of these scored the
# scale's 10 (1.000), and a chatty judge pushed every reward to the top. The ends of a range from 0 or 1 to 10 (a
# parenthesised word may follow the first: the template's "1 (very poor) to 10 (excellent)"), "/10" and "out of
# (a possible) 10" (the number before them is the score, `_OUT_OF`), an end that "is" / "being" / "=" / "means" a
# best or worst, "10-point", "scale of 10"
_SCALE = re.compile(
    r"(?<![0-9.])[01]\s*(?:\([^()\n]{0,40}\)\s*)?(?:-|–|—|to\b|through\b)\s*10(?!\.?[0-9])"
    r"|\bbetween\s+[01]\s+and\s+10(?!\.?[0-9])"
    r"|(?:/|\bout\s+of)\s*(?:a\s+(?:possible|maximum\s+of)\s+)?10(?!\.?[0-9])"
    r"|(?<![0-9.])(?:[01]|10)\s*(?:\bis\b|\bbeing\b|=|\bmeans\b|\brepresents\b)\s*(?:the\s+)?(?:very\s+)?"
    r"(?:best|worst|highest|lowest|top|bottom|max(?:imum)?|min(?:imum)?|perfect|excellent|poor|terrible)\b"
    r"|(?<![0-9.])10\s*-?\s*points?\b"
    r"|\bscale\s+of\s+10(?!\.?[0-9])",
    re.IGNORECASE)
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
# a reasoning judge (Qwen3-VL Thinking, DeepSeek-R1 style) thinks in <think>...</think> before it answers; its chat
# template may open the block itself, so the answer may hold only the closing tag
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


# ------------------------------------------------------------------------------------------------ the key


def _loopback(host: str) -> bool:
    """Whether ``host`` (a URL's host, lower case) is this machine by its spelling alone: ``localhost`` or a literal
    loopback address. Any other name is resolved by DNS when the request is sent (``judge.localhost`` included, on
    most systems), so an answer that moves it elsewhere would carry the key there over plain http."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_key_for(url: str, env: Mapping[str, str] = os.environ, allow_http: bool = False) -> tuple[str, str]:
    """(the key to send to the judge at ``url``, "") or ("", why a key that is set is withheld).

    ``SAGE_JUDGE_API_KEY`` is the judge's key: sent to ``url`` over https, or over plain http to this machine
    (loopback), or to another host over plain http when ``allow_http`` (--judge_allow_http_key). ``OPENAI_API_KEY``
    belongs to OpenAI: sent only when ``url`` is https://api.openai.com, never to another server."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    key = env.get(JUDGE_KEY_ENV, "")
    if not key:
        if parts.scheme == "https" and host == OPENAI_HOST:
            return env.get(OPENAI_KEY_ENV, ""), ""
        if env.get(OPENAI_KEY_ENV):
            return "", f"{OPENAI_KEY_ENV} is sent only to https://{OPENAI_HOST}; set {JUDGE_KEY_ENV} to the judge's key"
        return "", ""
    if parts.scheme == "http" and not _loopback(host) and not allow_http:
        return "", (f"{JUDGE_KEY_ENV} is not sent over plain http to {host} (anyone on the path could read it): use "
                    "https, or --judge_allow_http_key on a network you trust")
    return key, ""


# ------------------------------------------------------------------------------------------------ the template


def load_template(path: str, scale: str = "1-10") -> str:
    """The judging template: the text of the file ``path``, or the default of ``scale`` when ``path`` is empty; one
    SageGRPOError line for a file that is missing, unreadable, not UTF-8 or empty."""
    return read_judge_template(path) or DEFAULT_TEMPLATES[scale]


def render(template: str, prompt: str, frames: int) -> str:
    """The template with ``{prompt}`` and ``{frames}`` (the number of frames sent) replaced, in one pass (a prompt
    that contains ``{frames}`` stays as it is); other braces are left alone."""
    values = {"prompt": prompt, "frames": str(frames)}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


# ------------------------------------------------------------------------------------------------ the score


def score_span(text: str, scale: str = "1-10") -> tuple[float, int] | None:
    """(the score the answer ``text`` gives, the index of its first character), or None when it gives none.

    1-10: the number before "/10" or "out of 10", else the first labelled one ("score: 7", "Rating (1-10): 8"),
    else the last number; a number of a stated scale (`_SCALE`: "1 to 10", "(out of 10)", "where 10 is best") is
    never the score, so "7 on a scale of 1 to 10" is 7, as is "On a scale of 1 to 10, 7". yes_no: the first "yes"
    or "no" (1 / 0)."""
    if scale == "yes_no":
        m = _YES_NO.search(text)
        return None if m is None else (float(m.group(1).lower() == "yes"), m.start(1))
    stated = [s.span() for s in _SCALE.finditer(text)]

    def free(found: re.Match) -> bool:  # a number outside every statement of the scale
        return not any(a <= found.start(1) < b for a, b in stated)

    m = next(filter(free, _OUT_OF.finditer(text)), None) or next(filter(free, _LABELLED.finditer(text)), None)
    if m is None:
        found = [n for n in _ANY.finditer(text) if free(n)]
        m = found[-1] if found else None
    return None if m is None else (float(m.group(1)), m.start(1))


def _label(token: object, scale: str) -> int | None:
    """The score a candidate token stands for (" 7" -> 7, "Yes" -> 1), None when it is no score of ``scale``."""
    if not isinstance(token, str):
        return None
    t = token.strip().lower()
    if scale == "yes_no":
        return {"yes": 1, "no": 0}.get(t)
    return int(t) if re.fullmatch(r"[1-9]|10", t) else None


def _candidates(position: object) -> dict[str, float]:
    """{token: probability} of one answer position (a dict of ``logprobs.content``): the chosen token and the
    returned top candidates, the chosen one counted once. Entries that are not a string token with a finite
    log-probability are left out."""
    out: dict[str, float] = {}
    if not isinstance(position, Mapping):
        return out
    tops = position.get("top_logprobs")
    for c in [position, *(tops if isinstance(tops, list) else ())]:
        if not isinstance(c, Mapping):
            continue
        token, lp = c.get("token"), c.get("logprob")
        if isinstance(token, str) and isinstance(lp, (int, float)) and math.isfinite(lp):
            out.setdefault(token, math.exp(min(float(lp), 0.0)))  # a log-probability above 0 is rounding
    return out


@dataclass
class Reading:
    """What an answer says: ``score`` in [0, 1] (NaN with ``problem`` when none); when the split of a candidate "1"
    between 1 and a two-token 10 is still to be asked for, ``split_prefix`` (the answer up to and with that "1") and
    ``masses`` ({score: probability}, the "1" holding both), which `finish` completes with P("0") after the prefix."""

    score: float
    problem: str = ""
    split_prefix: str | None = None
    masses: dict[int, float] = field(default_factory=dict)
    text_score: float = math.nan  # the score of the answer's text, for a server that cannot continue an answer
    cut_off: bool = False  # the answer ended at its token budget (finish_reason "length"), before its end

    def finish(self, p0: float) -> float:
        """The score when P("0") after ``split_prefix`` is ``p0``."""
        return _expected({**self.masses, 1: self.masses[1] * (1 - p0), 10: self.masses.get(10, 0.0) +
                          self.masses[1] * p0})


def _expected(masses: dict[int, float]) -> float:
    """(E - 1) / 9 of the renormalised masses over 1..10."""
    return (sum(k * p for k, p in masses.items()) / sum(masses.values()) - 1) / 9


def _positions(choice: Mapping) -> list | None:
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    return content if isinstance(content, list) and content else None


def read_answer(answer: object, scale: str = "1-10") -> Reading:
    """Read a chat completion (the parsed JSON body) into a `Reading`; nothing in ``answer`` can make it raise."""
    if not isinstance(answer, Mapping):
        return Reading(math.nan, "an answer that is not a JSON object")
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return Reading(math.nan, "an answer with no choices")
    choice = choices[0]
    message = choice.get("message")
    content = message.get("content") if isinstance(message, Mapping) else None
    text = content if isinstance(content, str) else ""
    positions = _positions(choice)
    tokens = [p.get("token") if isinstance(p, Mapping) else None for p in positions or ()]
    if positions and all(isinstance(t, str) for t in tokens):
        text = "".join(tokens)  # the positions are the answer: the score's character maps to its token
    else:
        positions = None
    if choice.get("finish_reason") == "length":  # a number read from a cut answer is whatever came last, no score
        return Reading(math.nan, f"an answer cut off at its token budget (finish_reason 'length'; "
                                 f"--judge_max_tokens) ending {text[-60:]!r}", cut_off=True)
    # the answer after a reasoning block: numbers thought aloud are no score
    begin = text.rfind(THINK_CLOSE)
    if begin < 0 and THINK_OPEN in text:
        return Reading(math.nan, f"a reasoning block with no answer after it, ending {text[-60:]!r}")
    begin = 0 if begin < 0 else begin + len(THINK_CLOSE)
    span = score_span(text[begin:], scale)
    if span is None:
        return Reading(math.nan, f"no score in the answer {text[begin:][:80]!r}")
    value, start = span[0], span[1] + begin
    text_score = value if scale == "yes_no" else (value - 1) / 9 if 1 <= value <= 10 else math.nan
    if not math.isfinite(text_score):
        return Reading(math.nan, f"a score outside 1..10 in the answer {text[:80]!r}")
    if positions is None:
        return Reading(text_score, text_score=text_score)
    ends = [0]
    for t in tokens:
        ends.append(ends[-1] + len(t))
    i = next(j for j in range(len(tokens)) if ends[j + 1] > start)  # the token holding the score's first character
    if _label(tokens[i], scale) is None:
        # the score shares its token with other characters ("9." or "Yes." as one token): the candidates that are
        # scores on their own are its minor rivals, not its probability; the text is what is known
        return Reading(text_score, text_score=text_score)
    masses: dict[int, float] = {}
    ones: dict[str, float] = {}  # the candidates read as "1", by token
    for token, p in _candidates(positions[i]).items():
        k = _label(token, scale)
        if k is not None:
            masses[k] = masses.get(k, 0.0) + p
            if scale == "1-10" and k == 1:
                ones[token] = p
    if not masses:  # no candidate with a usable probability: the text is what is known
        return Reading(text_score, text_score=text_score)
    if scale == "yes_no":
        return Reading(masses.get(1, 0.0) / sum(masses.values()), text_score=text_score)
    if 10 in masses or not ones or masses[1] / sum(masses.values()) < SPLIT_MIN:
        return Reading(_expected(masses), text_score=text_score)  # a tokenizer with a token "10", or no real "1"
    reading = Reading(math.nan, masses=masses, text_score=text_score)
    if _label(tokens[i], scale) == 1 and i + 1 < len(positions):  # "1" was chosen: the next position splits it
        reading.score = reading.finish(_candidates(positions[i + 1]).get("0", 0.0))
        return reading
    reading.split_prefix = text[:ends[i]] + max(ones, key=ones.get)
    return reading


# ------------------------------------------------------------------------------------------------ the request


def _png_part(frame: torch.Tensor) -> dict:
    """float [3, H, W] in [0, 1] -> an ``image_url`` part holding the frame as a base64 PNG (lossless)."""
    from PIL import Image

    from sage_grpo.video import frames_to_uint8

    buf = io.BytesIO()
    Image.fromarray(frames_to_uint8(frame[None])[0]).save(buf, format="PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}


def _mp4_part(frames: torch.Tensor, fps: float) -> dict:
    """float [n, 3, H, W] in [0, 1] -> a ``video_url`` part holding them as a base64 H.264 mp4 at ``fps``."""
    from sage_grpo.video import write_video

    with tempfile.TemporaryDirectory() as d:
        data = write_video(Path(d) / "judge.mp4", frames, fps=fps).read_bytes()
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}


class AnswerError(Exception):
    """An answer that came back but cannot be used (an error body, too large, too slow, not JSON)."""


class NotContinued(AnswerError):
    """A request to continue an answer answered as a new turn: the server ignores ``continue_final_message``."""


def _first_token(answer: Mapping) -> str:
    """The chosen token of an answer's first position, "" when it has none."""
    choices = answer.get("choices")
    positions = _positions(choices[0]) if isinstance(choices, list) and choices and \
        isinstance(choices[0], Mapping) else None
    token = positions[0].get("token") if positions and isinstance(positions[0], Mapping) else None
    return token if isinstance(token, str) else ""


# vLLM's and SGLang's chat parameters that continue the last (assistant) message instead of starting a new turn
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


class VLMJudge:
    """`Reward` scored by a VLM behind an OpenAI-compatible chat endpoint; see the module docstring."""

    components = ("judge",)
    default_weights = {"judge": 1.0}
    runs_on_cpu = True  # it encodes CPU frames and waits on the network: the overlap scores it in a worker thread

    def __init__(self, url: str, model: str = "", template: str = DEFAULT_TEMPLATES["1-10"], scale: str = "1-10",
                 frames: int = _DEFAULTS.judge_frames, video: bool = False,
                 concurrency: int = _DEFAULTS.judge_concurrency, timeout: float = _DEFAULTS.reward_timeout,
                 retries: int = _DEFAULTS.reward_retries, video_fps: float = VIDEO_FPS,
                 allow_http_key: bool = False, max_tokens: int = _DEFAULTS.judge_max_tokens,
                 env: Mapping[str, str] | None = None):
        """``url``: the server's base URL (``/v1`` appended unless given); ``model``: the name sent with each
        request, empty = the one model the server lists; ``template``: the judging text ({prompt}, {frames});
        ``scale``: 1-10 or yes_no; ``frames``: frames sent per video; ``video``: send them as one mp4 part;
        ``concurrency``: requests in flight at once; ``timeout``: seconds one try of a request may take, sending to
        last byte; ``retries`` per request; ``video_fps``: the frame rate of the videos scored (the mp4's duration);
        ``allow_http_key`` and ``env`` (default the process environment): where the key comes from and may go
        (`api_key_for`); ``max_tokens``: the answer's token budget (an answer cut off there is NaN)."""
        import openai

        if scale not in JUDGE_SCALES:
            raise SageGRPOError(f"--judge_scale must be one of {', '.join(JUDGE_SCALES)}, got {scale!r}")
        self.url = url.strip().rstrip("/")
        base = self.url if self.url.endswith("/v1") else self.url + "/v1"
        api_key, self.withheld = api_key_for(self.url, os.environ if env is None else env, allow_http_key)
        if self.withheld:
            warnings.warn(f"no API key is sent to the judge server {self.url}: {self.withheld}", RuntimeWarning,
                          stacklevel=2)
        self.timeout = float(timeout)
        self.max_tokens = int(max_tokens)
        self.max_answer_bytes = max(MAX_ANSWER_BYTES, self.max_tokens * POSITION_BYTES)
        # the client needs a key; servers started without one (vllm serve without --api-key) ignore it
        self.client = openai.OpenAI(base_url=base, api_key=api_key or "EMPTY", timeout=self.timeout,
                                    max_retries=int(retries), http_client=deadline_client(self.timeout))
        self.template, self.scale, self.frames, self.video = template, scale, int(frames), bool(video)
        self.concurrency, self.video_fps = int(concurrency), float(video_fps)
        self.logprobs = True  # asked for until the server refuses them
        self.continues = True  # whether the server continues an answer (the split of a two-token 10)
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self.model = model.strip() or self._served_model()
        self._probe()

    # ---------------------------------------------------------------- checks when the reward is built

    def _fail(self, err: Exception, doing: str) -> SageGRPOError:
        """One error line for a server that could not be used while ``doing``."""
        import openai

        if isinstance(err, (openai.AuthenticationError, openai.PermissionDeniedError)):
            why = self.withheld or f"set {JUDGE_KEY_ENV} to its key"
            return SageGRPOError(f"judge server {self.url} refused the API key ({err.status_code}) {doing}: {why}")
        if isinstance(err, openai.APIStatusError):
            return SageGRPOError(f"judge server {self.url} answered {err.status_code} {doing}: "
                                 f"{_one_line(err)[:300]}")
        if isinstance(err, AnswerError):
            return SageGRPOError(f"judge server {self.url} {doing}: {_one_line(err)[:300]}")
        return SageGRPOError(f"judge server {self.url} cannot be reached {doing} ({type(err).__name__}: "
                             f"{_one_line(err)[:300]}); start it (e.g. vllm serve MODEL) or check --judge_url")

    def _served_model(self) -> str:
        """The one model the server lists (GET /v1/models); one error line when it lists none or several."""
        import openai

        try:
            names = [m.id for m in self.client.models.list()]
        except openai.OpenAIError as err:
            raise self._fail(err, "listing its models") from None
        if len(names) != 1:
            raise SageGRPOError(f"judge server {self.url} serves {len(names)} models"
                                f"{' (' + ', '.join(names[:10]) + ')' if names else ''}: name the judge with "
                                "--judge_model")
        return names[0]

    def _probe(self) -> None:
        """One request like the ones training sends (gray frames, a test prompt): a server that refuses it (the
        model's name, more images than it takes, a video part it cannot read) is one error line now, and whether it
        returns log-probabilities, and continues an answer, is known before training."""
        import openai

        gray = torch.full((self.frames, 3, PROBE_SIZE, PROBE_SIZE), 0.5)  # [n, 3, H, W]
        messages = self._messages(gray, "a test video", self.frames / self.video_fps)
        try:
            answer = self._ask(messages)
        except (openai.OpenAIError, AnswerError) as err:
            raise self._fail(err, f"a request with {self.frames} frames for model {self.model!r}") from None
        reading = self._read(answer)
        if reading.cut_off:  # every answer like it would be NaN
            raise SageGRPOError(f"judge server {self.url}: the answer to a test request was cut off at "
                                f"--judge_max_tokens {self.max_tokens} before its end (finish_reason 'length'), so "
                                "every score would be NaN: raise --judge_max_tokens (a reasoning judge, which thinks "
                                "before it answers, needs hundreds to thousands)")
        if reading.problem:
            self._warn_once("probe", f"the judge's answer to a test request has {reading.problem}; videos whose "
                                     "answers have none score NaN")
        if self.logprobs and self.scale == "1-10" and _positions(answer["choices"][0]) is not None:
            try:
                self._p0(messages, "1", _first_token(answer))
            except (openai.BadRequestError, openai.UnprocessableEntityError, AnswerError) as err:
                self._cannot_continue(err)
            except openai.OpenAIError as err:
                raise self._fail(err, "continuing an answer after '1'") from None

    def _cannot_continue(self, err: Exception) -> None:
        """From now on, the answer's text where the split of a "1" would need a continuation (one warning)."""
        self.continues = False
        self._warn_once("continue", f"the judge server cannot continue an answer ({_one_line(err)[:200]}): where "
                                    "the judge gives the token '1' some probability without choosing it, the score "
                                    "is the answer's text, not its expected value")

    # ---------------------------------------------------------------- scoring

    def _messages(self, frames: torch.Tensor, prompt: str, seconds: float) -> list[dict]:
        """The chat messages for one video's frames float [n, 3, H, W] in [0, 1] (CPU) lasting ``seconds``."""
        n = frames.shape[0]
        media = [_mp4_part(frames, n / seconds)] if self.video else [_png_part(f) for f in frames]
        return [{"role": "user", "content": [*media, {"type": "text", "text": render(self.template, prompt, n)}]}]

    def _post(self, **kwargs) -> dict:
        """One chat completion (the client retries what can be retried) -> its JSON body. The body is read here, a
        chunk at a time: a try whose answer is still coming ``timeout`` seconds after its sending (the client's
        deadline, `deadline_client`; headers still coming then are a timeout, which the client retries), or an
        answer over ``max_answer_bytes``, is an AnswerError; so is a body that is not a JSON object or holds an
        ``error``."""
        import httpx

        cap = self.max_answer_bytes
        kwargs = dict(model=self.model, temperature=0.0, extra_headers={"Accept-Encoding": "identity"}, **kwargs)
        with self.client.chat.completions.with_streaming_response.create(**kwargs) as response:
            size = response.headers.get("content-length", "")
            if size.isdigit() and int(size) > cap:
                raise AnswerError(f"an answer of {int(size):,} bytes (more than {cap:,})")
            body = bytearray()
            try:
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) > cap:
                        raise AnswerError(f"an answer of more than {cap:,} bytes")
            except httpx.TimeoutException:
                raise AnswerError(f"an answer still coming {self.timeout:g} s after the request "
                                  "(--reward_timeout)") from None
        try:
            data = json.loads(body)
        except ValueError:
            raise AnswerError(f"an answer that is not JSON: {bytes(body[:120])!r}") from None
        if not isinstance(data, dict):
            raise AnswerError(f"an answer that is not a JSON object: {bytes(body[:120])!r}")
        if "error" in data:
            err = data["error"]
            message = err.get("message", err) if isinstance(err, Mapping) else err
            raise AnswerError(f"the server answered an error: {' '.join(str(message).split())[:300]}")
        return data

    def _ask(self, messages: list[dict]) -> dict:
        """The judge's answer to ``messages``: with log-probabilities while the server takes them."""
        import openai

        if not self.logprobs:
            return self._post(messages=messages, max_tokens=self.max_tokens)
        try:
            return self._post(messages=messages, max_tokens=self.max_tokens, logprobs=True,
                              top_logprobs=TOP_LOGPROBS)
        except (openai.BadRequestError, openai.UnprocessableEntityError) as err:
            answer = self._post(messages=messages, max_tokens=self.max_tokens)  # raises when the request is refused
            self.logprobs = False
            self._warn_once("logprobs", f"the judge server refuses log-probabilities ({err.status_code}: "
                                        f"{_one_line(err)[:200]}); scores are read from the answers' text")
            return answer

    def _p0(self, messages: list[dict], prefix: str, first: str) -> float:
        """P("0") at the first position after the judge's answer ``prefix`` (continued, not a new turn).

        A server that ignores ``continue_final_message`` answers a new turn, whose first position holds no "0" (so
        a "1" would be read as 1, not 10): `NotContinued` when that position starts an answer rather than follows a
        "1", its chosen token a score of its own ("9" after "1" is no score) or ``first``, the chosen first token of
        the judge's answer to the same request (temperature 0 answers it again)."""
        answer = self._post(messages=[*messages, {"role": "assistant", "content": prefix}], max_tokens=1,
                            logprobs=True, top_logprobs=TOP_LOGPROBS, extra_body=CONTINUE)
        choices = answer.get("choices")
        positions = _positions(choices[0]) if isinstance(choices, list) and choices and \
            isinstance(choices[0], Mapping) else None
        if positions is None:
            raise AnswerError("an answer after the prefix with no log-probabilities")
        chosen = _first_token(answer)
        if _label(chosen, "1-10") is not None or (chosen.strip() and chosen == first):
            raise NotContinued(f"it answers a new turn instead, ignoring continue_final_message: after {prefix!r} "
                               f"its answer begins {chosen!r}, as its answer to the request itself does")
        return _candidates(positions[0]).get("0", 0.0)

    def _score(self, answer: dict, messages: list[dict]) -> tuple[float, str]:
        """(the answer's score in [0, 1], "") or (NaN, what it lacks)."""
        reading = self._read(answer)
        if reading.split_prefix is None:
            return reading.score, reading.problem
        if self.continues:
            try:
                return reading.finish(self._p0(messages, reading.split_prefix, _first_token(answer))), ""
            except NotContinued as err:
                self._cannot_continue(err)
        return reading.text_score, ""

    def _read(self, answer: dict) -> Reading:
        """`read_answer`, with one warning when the server returns no log-probabilities though asked for them."""
        choices = answer.get("choices")
        if self.logprobs and isinstance(choices, list) and choices and isinstance(choices[0], Mapping) and \
                _positions(choices[0]) is None:
            self._warn_once("no logprobs", "the judge server returns no log-probabilities; scores are read from "
                                           "the answers' text")
        return read_answer(answer, self.scale)

    def _warn_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _score_one(self, frames: torch.Tensor, prompt: str, seconds: float) -> tuple[float, str]:
        """(score, "") or (NaN, what went wrong) for one video."""
        try:
            messages = self._messages(frames, prompt, seconds)
            return self._score(self._ask(messages), messages)
        except Exception as err:  # noqa: BLE001 - network, server and answer errors all end as NaN
            return math.nan, f"{type(err).__name__}: {_one_line(err)[:200]}"

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score float [B, F, 3, H, W] in [0, 1] -> {"judge": float32 [B]} (NaN where the judge failed)."""
        n, seconds = videos.shape[0], videos.shape[1] / self.video_fps
        frames = apply_read({"frames": {"count": self.frames}}, videos).cpu()  # [B, n, 3, H, W]
        with ThreadPoolExecutor(max(1, min(self.concurrency, n)), thread_name_prefix="judge") as pool:
            results = list(pool.map(self._score_one, frames, prompts, [seconds] * n))
        errors = [e for _, e in results if e]
        if errors:
            warnings.warn(f"the judge failed on {len(errors)} of {n} videos ({errors[-1]}); their scores are NaN",
                          RuntimeWarning, stacklevel=2)
        return {"judge": torch.tensor([s for s, _ in results], dtype=torch.float32, device=videos.device)}


def check_installed() -> None:
    """One SageGRPOError line naming the pip command when a package the judge imports is missing: the openai client,
    and httpx, which `deadline_client` builds the client's transport on. openai 3 depends on httpx2, not httpx (and
    so does huggingface_hub 2), so an install of openai alone has no httpx: the judge then died in setup with a
    ModuleNotFoundError traceback, after the run folder was made. post_train.py's preflight calls this (the
    builder's ``check_installed``) before either."""
    for module in ("openai", "httpx"):
        try:
            importlib.import_module(module)
        except ImportError as err:  # missing, or broken (what it lacks is named)
            raise SageGRPOError(f"the vlm_judge reward needs the openai and httpx packages ({_one_line(err)}): "
                                "pip install 'sage-grpo[judge]'") from None


@register_reward("vlm_judge")
def build_vlm_judge(judge_url: str = _DEFAULTS.judge_url, judge_model: str = _DEFAULTS.judge_model,
                    judge_template: str = _DEFAULTS.judge_template, judge_scale: str = _DEFAULTS.judge_scale,
                    judge_frames: int = _DEFAULTS.judge_frames, judge_video: bool = _DEFAULTS.judge_video,
                    judge_concurrency: int = _DEFAULTS.judge_concurrency,
                    judge_allow_http_key: bool = _DEFAULTS.judge_allow_http_key,
                    judge_max_tokens: int = _DEFAULTS.judge_max_tokens,
                    reward_timeout: float = _DEFAULTS.reward_timeout, reward_retries: int = _DEFAULTS.reward_retries,
                    video_fps: float = VIDEO_FPS, **_: object) -> VLMJudge:
    """Builder of the VLM judge (the reward flags of the same names)."""
    check_installed()
    return VLMJudge(check_judge_url(judge_url), model=judge_model,
                    template=load_template(judge_template, judge_scale), scale=judge_scale, frames=judge_frames,
                    video=judge_video, concurrency=judge_concurrency, timeout=reward_timeout, retries=reward_retries,
                    video_fps=video_fps, allow_http_key=judge_allow_http_key, max_tokens=judge_max_tokens)


build_vlm_judge.check_installed = check_installed  # what post_train.py's preflight asks before the run starts
