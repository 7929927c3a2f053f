"""A VLM judge over an OpenAI-compatible chat endpoint: ``--reward_model vlm_judge --judge_url http://host:port``.

Any server of the OpenAI chat API serves it (vLLM, SGLang, ``transformers serve``). For each video, one request to
``<judge_url>/v1/chat/completions`` holds one user message: ``--judge_frames`` evenly spaced frames as base64 PNG
``image_url`` parts (or, with ``--judge_video``, one mp4 ``video_url`` part), then the judging template with the
video's prompt in it. The client is the ``openai`` package: its timeout, retries with exponential backoff (connection
errors, 408, 409, 429, 5xx; never a refused key) and the API key of ``SAGE_JUDGE_API_KEY`` or ``OPENAI_API_KEY``.

The score, in [0, 1] (component ``judge``):

* from the answer's token log-probabilities where the server returns them (asked with ``logprobs`` and
  ``top_logprobs``): at the first answer token that is a score, the expected value over "1".."10" among the
  returned candidates, renormalised, as (E - 1) / 9; or P(yes) / (P(yes) + P(no)) for ``--judge_scale yes_no``;
* else from the answer's text: its first number n in [1, 10] as (n - 1) / 9 (another number is NaN), or its first
  "yes" / "no" as 1 / 0.

A server that refuses the log-probability fields (a 400 or 422 that a request without them does not get) is asked
without them from then on. A request that still fails after the retries, or an answer with no score, is NaN (one
warning per call), as for the other remote rewards, so the failed-reward policy (``--max_failed_reward_steps``)
applies. When the reward is built, the server's model list and one request like the ones training sends (gray
frames) are checked, so a server that cannot be reached, refuses the key or refuses such a request is one error
line before the policy loads.
"""

from __future__ import annotations

import base64
import io
import math
import os
import re
import tempfile
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from sage_grpo.config import JUDGE_SCALES, VIDEO_FPS, RewardConfig
from sage_grpo.errors import SageGRPOError
from sage_grpo.rewards.base import _one_line, register_reward
from sage_grpo.rewards.remote import apply_read

__all__ = ["API_KEY_ENVS", "DEFAULT_TEMPLATES", "VLMJudge", "check_url", "load_template", "parse_score", "render",
           "score_from_logprobs"]

API_KEY_ENVS = ("SAGE_JUDGE_API_KEY", "OPENAI_API_KEY")  # the first one set is sent as the bearer token
TOP_LOGPROBS = 20  # the most that OpenAI's API and vLLM's default --max-logprobs return
MAX_TOKENS = 16  # the templates ask for a number or a word; room for a short preamble such as "Score: 7"
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
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


# ------------------------------------------------------------------------------------------------ the flags


def check_url(url: str) -> str:
    """``--judge_url`` stripped; one SageGRPOError line when it is empty, several, or not http(s)."""
    url = url.strip()
    if not url:
        raise SageGRPOError("--reward_model vlm_judge needs --judge_url http://host:port (an OpenAI-compatible chat "
                            "server: vllm serve, python -m sglang.launch_server, transformers serve)")
    if "," in url:
        raise SageGRPOError(f"--judge_url takes one server, got {url!r} (put several behind a load balancer)")
    if not url.startswith(("http://", "https://")):
        raise SageGRPOError(f"--judge_url {url!r} must start with http:// or https://")
    return url


# ------------------------------------------------------------------------------------------------ the template


def load_template(path: str, scale: str = "1-10") -> str:
    """The judging template: the text of the file ``path``, or the default of ``scale`` when ``path`` is empty; one
    SageGRPOError line for a file that is missing, unreadable, not UTF-8 or empty."""
    if not path.strip():
        return DEFAULT_TEMPLATES[scale]
    p = Path(path).expanduser()
    hint = "a UTF-8 text file with the judging prompt, {prompt} standing for the video's prompt"
    if not p.is_file():
        raise SageGRPOError(f"--judge_template {path}: no such file ({hint}; relative to the working directory "
                            f"{Path.cwd()})")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SageGRPOError(f"--judge_template {path} cannot be read ({type(err).__name__}: {_one_line(err)}; "
                            f"{hint})") from None
    if not text.strip():
        raise SageGRPOError(f"--judge_template {path} is empty ({hint})")
    return text


def render(template: str, prompt: str, frames: int) -> str:
    """The template with ``{prompt}`` and ``{frames}`` (the number of frames sent) replaced, in one pass (a prompt
    that contains ``{frames}`` stays as it is); other braces are left alone."""
    values = {"prompt": prompt, "frames": str(frames)}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


# ------------------------------------------------------------------------------------------------ the score


def _label(token: str, scale: str) -> int | None:
    """The score a token stands for (" 7" -> 7, "Yes" -> 1), None when it is no score of ``scale``."""
    t = token.strip().lower()
    if scale == "yes_no":
        return {"yes": 1, "no": 0}.get(t)
    return int(t) if t.isdigit() and t == str(int(t)) and 1 <= int(t) <= 10 else None


def _candidates(position) -> dict[str, float]:
    """{token: probability} of one answer position: the chosen token and the returned top candidates (the chosen
    one is usually among them: counted once)."""
    out = {position.token: math.exp(position.logprob)}
    for c in position.top_logprobs or ():
        out.setdefault(c.token, math.exp(c.logprob))
    return out


def score_from_logprobs(content: Sequence, scale: str = "1-10") -> float | None:
    """The score in [0, 1] from a chat answer's ``logprobs.content`` (positions with ``token``, ``logprob`` and
    ``top_logprobs``), read at the first position whose chosen token is a score; None when there is none.

    1-10: E = sum_k k p_k / sum_k p_k over the candidates "1".."10" (leading spaces ignored), as (E - 1) / 9. A
    tokenizer that writes 10 as "1" then "0" gives "1" the probability of both: when "1" is the chosen token, the
    next position's P("0") splits it (10 with p_1 P("0"), 1 with p_1 (1 - P("0"))); when it is not, that next
    position is not known and all of p_1 counts as 1. yes_no: P(yes) / (P(yes) + P(no)).
    """
    for i, pos in enumerate(content):
        if _label(pos.token, scale) is None:
            continue
        mass: dict[int, float] = {}
        for token, p in _candidates(pos).items():
            k = _label(token, scale)
            if k is not None:
                mass[k] = mass.get(k, 0.0) + p
        if scale == "1-10" and pos.token.strip() == "1" and i + 1 < len(content):
            p0 = sum(p for t, p in _candidates(content[i + 1]).items() if t == "0")
            p1 = mass[1]
            mass[1], mass[10] = p1 * (1 - p0), mass.get(10, 0.0) + p1 * p0
        total = sum(mass.values())
        if scale == "yes_no":
            return mass.get(1, 0.0) / total
        return (sum(k * p for k, p in mass.items()) / total - 1) / 9
    return None


def parse_score(text: str, scale: str = "1-10") -> float:
    """The score in [0, 1] from an answer's text: its first number n as (n - 1) / 9 when 1 <= n <= 10, its first
    "yes" / "no" (any case) as 1 / 0 for yes_no; NaN otherwise."""
    if scale == "yes_no":
        m = _YES_NO.search(text)
        return math.nan if m is None else float(m.group(1).lower() == "yes")
    m = _NUMBER.search(text)
    n = math.nan if m is None else float(m.group())
    return (n - 1) / 9 if 1 <= n <= 10 else math.nan


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


class VLMJudge:
    """`Reward` scored by a VLM behind an OpenAI-compatible chat endpoint; see the module docstring."""

    components = ("judge",)
    default_weights = {"judge": 1.0}
    runs_on_cpu = True  # it encodes CPU frames and waits on the network: the overlap scores it in a worker thread

    def __init__(self, url: str, model: str = "", template: str = DEFAULT_TEMPLATES["1-10"], scale: str = "1-10",
                 frames: int = _DEFAULTS.judge_frames, video: bool = False,
                 concurrency: int = _DEFAULTS.judge_concurrency, timeout: float = _DEFAULTS.reward_timeout,
                 retries: int = _DEFAULTS.reward_retries, video_fps: float = VIDEO_FPS, api_key: str | None = None):
        """``url``: the server's base URL (``/v1`` appended unless given); ``model``: the name sent with each
        request, empty = the one model the server lists; ``template``: the judging text ({prompt}, {frames});
        ``scale``: 1-10 or yes_no; ``frames``: frames sent per video; ``video``: send them as one mp4 part;
        ``concurrency``: requests in flight at once; ``timeout`` (seconds) and ``retries`` per request; ``video_fps``:
        the frame rate of the videos scored (the mp4's duration); ``api_key``: default the first of
        `API_KEY_ENVS` that is set."""
        import openai

        if scale not in JUDGE_SCALES:
            raise SageGRPOError(f"--judge_scale must be one of {', '.join(JUDGE_SCALES)}, got {scale!r}")
        self.url = url.strip().rstrip("/")
        base = self.url if self.url.endswith("/v1") else self.url + "/v1"
        if api_key is None:
            api_key = next((os.environ[k] for k in API_KEY_ENVS if os.environ.get(k)), "")
        # the client needs a key; servers started without one (vllm serve without --api-key) ignore it
        self.client = openai.OpenAI(base_url=base, api_key=api_key or "EMPTY", timeout=float(timeout),
                                    max_retries=int(retries))
        self.template, self.scale, self.frames, self.video = template, scale, int(frames), bool(video)
        self.concurrency, self.video_fps = int(concurrency), float(video_fps)
        self.logprobs = True  # asked for until the server refuses them
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self.model = model.strip() or self._served_model()
        self._probe()

    # ---------------------------------------------------------------- checks when the reward is built

    def _fail(self, err: Exception, doing: str) -> SageGRPOError:
        """One error line for a server that could not be used while ``doing``."""
        import openai

        if isinstance(err, (openai.AuthenticationError, openai.PermissionDeniedError)):
            return SageGRPOError(f"judge server {self.url} refused the API key ({err.status_code}) {doing}: set "
                                 f"{API_KEY_ENVS[0]} (or {API_KEY_ENVS[1]}) to its key")
        if isinstance(err, openai.APIStatusError):
            return SageGRPOError(f"judge server {self.url} answered {err.status_code} {doing}: "
                                 f"{_one_line(err)[:300]}")
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
        returns log-probabilities is known before training."""
        import openai

        gray = torch.full((self.frames, 3, PROBE_SIZE, PROBE_SIZE), 0.5)  # [n, 3, H, W]
        try:
            answer = self._ask(self._messages(gray, "a test video", self.frames / self.video_fps))
        except openai.OpenAIError as err:
            raise self._fail(err, f"a request with {self.frames} frames for model {self.model!r}") from None
        _, problem = self._score(answer)
        if problem:
            self._warn_once("probe", f"the judge's answer to a test request has {problem}; videos whose answers "
                                     "have none score NaN")

    # ---------------------------------------------------------------- scoring

    def _messages(self, frames: torch.Tensor, prompt: str, seconds: float) -> list[dict]:
        """The chat messages for one video's frames float [n, 3, H, W] in [0, 1] (CPU) lasting ``seconds``."""
        n = frames.shape[0]
        media = [_mp4_part(frames, n / seconds)] if self.video else [_png_part(f) for f in frames]
        return [{"role": "user", "content": [*media, {"type": "text", "text": render(self.template, prompt, n)}]}]

    def _ask(self, messages: list[dict]):
        """One chat completion (the client retries what can be retried); with log-probabilities while the server
        takes them."""
        import openai

        kwargs = dict(model=self.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0)
        if not self.logprobs:
            return self.client.chat.completions.create(**kwargs)
        try:
            return self.client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=TOP_LOGPROBS)
        except (openai.BadRequestError, openai.UnprocessableEntityError) as err:
            answer = self.client.chat.completions.create(**kwargs)  # raises when the request itself is refused
            self.logprobs = False
            self._warn_once("logprobs", f"the judge server refuses log-probabilities ({err.status_code}: "
                                        f"{_one_line(err)[:200]}); scores are parsed from the answers")
            return answer

    def _score(self, answer) -> tuple[float, str]:
        """(the answer's score in [0, 1], "") or (NaN, what it lacks)."""
        if not answer.choices:
            return math.nan, "no choices"
        choice = answer.choices[0]
        content = getattr(getattr(choice, "logprobs", None), "content", None)
        if content:
            score = score_from_logprobs(content, self.scale)
            if score is not None:
                return score, ""
        elif self.logprobs:
            self._warn_once("no logprobs", "the judge server returns no log-probabilities; scores are parsed from "
                                           "the answers' text")
        text = choice.message.content or ""
        score = parse_score(text, self.scale)
        return score, "" if math.isfinite(score) else f"no score in the answer {text[:80]!r}"

    def _warn_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _score_one(self, frames: torch.Tensor, prompt: str, seconds: float) -> tuple[float, str]:
        """(score, "") or (NaN, what went wrong) for one video."""
        try:
            return self._score(self._ask(self._messages(frames, prompt, seconds)))
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


@register_reward("vlm_judge")
def build_vlm_judge(judge_url: str = _DEFAULTS.judge_url, judge_model: str = _DEFAULTS.judge_model,
                    judge_template: str = _DEFAULTS.judge_template, judge_scale: str = _DEFAULTS.judge_scale,
                    judge_frames: int = _DEFAULTS.judge_frames, judge_video: bool = _DEFAULTS.judge_video,
                    judge_concurrency: int = _DEFAULTS.judge_concurrency,
                    reward_timeout: float = _DEFAULTS.reward_timeout, reward_retries: int = _DEFAULTS.reward_retries,
                    video_fps: float = VIDEO_FPS, **_: object) -> VLMJudge:
    """Builder of the VLM judge (the reward flags of the same names)."""
    try:
        import openai  # noqa: F401
    except ImportError:
        raise SageGRPOError("--reward_model vlm_judge needs the openai package: pip install 'sage-grpo[judge]'") \
            from None
    return VLMJudge(check_url(judge_url), model=judge_model, template=load_template(judge_template, judge_scale),
                    scale=judge_scale, frames=judge_frames, video=judge_video, concurrency=judge_concurrency,
                    timeout=reward_timeout, retries=reward_retries, video_fps=video_fps)
