"""A reward scored by reward servers (`scripts/serve_reward.py`) over HTTP: ``--reward_model remote --reward_url URL``.

What travels: only what the served reward reads. A reward may declare ``read_spec`` (which frames, at which size;
executed here by `apply_read`, the same code the reward runs) and ``score_read`` (scores what `apply_read` returned);
the client then sends those frames, as uint8 when the reward quantises them itself (VideoAlign), else in the video's
own dtype. Without ``read_spec`` the whole decoded video is sent. The body is a safetensors file (tensors and the
prompts as UTF-8 bytes, never a pickle) compressed with zlib: lossless, so remote scores equal local ones.

Several URLs: servers that report the same reward (components, version and the settings that change its scores:
checkpoint, step, dtype, pixels, frame rates) are replicas, tried in turn starting from one chosen by the rank and
the call (the load spreads over ranks and calls); servers of different rewards are combined, each contributing its
components. A request that times out (each try ends ``--reward_timeout`` seconds after it was sent, its headers and
body however slowly they come: `deadline_client`) or fails is retried with exponential backoff on the next replica
(a refused token or a body over the server's limit, 413, is not: no retry can change it); what still fails is NaN
(one warning), so the failed-reward policy (`--max_failed_reward_steps`) applies. A server that cannot
be reached when the run starts, refuses the token, answers /info with an error (503: its batcher stopped), or serves
the same reward with other settings as another, is one error line instead.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import warnings
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from sage_grpo.errors import SageGRPOError
from sage_grpo.rewards.base import _one_line, register_reward

__all__ = ["TOKEN_ENV", "BodyTooLarge", "RemoteReward", "apply_read", "deadline_client", "encode_batch",
           "decode_batch", "read_spec_of"]

TOKEN_ENV = "SAGE_REWARD_TOKEN"  # bearer token: checked by the server when set there, sent by the client when set
CONTENT_TYPE = "application/x-safetensors+zlib"
# the largest request body a server takes by default (serve_reward.py --max_request_mb), compressed and again
# decoded (the decompressed bytes plus the float32 copy of uint8 frames): a longer body is refused (413) before it
# is read, a larger decoded one once its header is read, so a request holds at most its body and this much. Three
# whole 121-frame 720p videos in float32 (1.25 GiB each) fit; VideoAlign's frames travel as uint8, far smaller.
MAX_BODY_BYTES = 4 << 30


# ------------------------------------------------------------------------------------------------ what is read


def read_spec_of(reward) -> dict | None:
    """The reward's ``read_spec`` (a JSON-able dict) when it also has ``score_read``; None = it reads whole videos."""
    spec = getattr(reward, "read_spec", None)
    return dict(spec) if spec is not None and callable(getattr(reward, "score_read", None)) else None


def apply_read(spec: Mapping | None, videos: torch.Tensor) -> torch.Tensor:
    """Reduce videos float [B, F, 3, H, W] in [0, 1] to what a reward with ``read_spec`` ``spec`` reads.

    ``{"frames": {"count": n}}``: n evenly spaced frames (all when n <= 0 or n >= F), values unchanged.
    ``{"frames": {"sample_fps": s, "video_fps": v}, "size": {"min_pixels", "max_pixels", "quantize"}}``: VideoAlign's
    frame sampling and smart resize -> float [B, n, 3, h, w] in [0, 255] (integers when quantize).
    None: the videos unchanged.
    """
    if spec is None:
        return videos
    from sage_grpo.rewards.video_preprocess import read_frames, resize_read

    frames = spec.get("frames") or {}
    if "count" in frames:
        nf, n = videos.shape[1], int(frames["count"])
        n = nf if n <= 0 else min(n, nf)
        return videos.index_select(1, torch.linspace(0, nf - 1, n).round().long().to(videos.device))
    if "sample_fps" in frames:
        x = read_frames(videos, float(frames["video_fps"]), float(frames["sample_fps"]))  # [B, n, 3, H, W]
        size = spec.get("size")
        if size:
            x = resize_read(x, int(size["min_pixels"]), int(size["max_pixels"]), bool(size["quantize"]))
        return x
    raise ValueError(f"unknown read_spec {dict(spec)!r}")


def wire_dtype(spec: Mapping | None) -> torch.dtype | None:
    """uint8 when the read values are whole numbers in [0, 255] (lossless and 4x smaller), else None (as they are)."""
    size = (spec or {}).get("size") or {}
    return torch.uint8 if size.get("quantize") else None


# ------------------------------------------------------------------------------------------------ wire format


def encode_batch(x: torch.Tensor, prompts: Sequence[str], dtype: torch.dtype | None = None) -> bytes:
    """Frames (any shape) and prompts -> zlib-compressed safetensors bytes (the request body)."""
    from safetensors.torch import save

    x = x.detach().cpu()
    if dtype is not None:
        x = x.round().clamp(0, 255).to(dtype) if dtype == torch.uint8 else x.to(dtype)
    text = torch.frombuffer(bytearray(json.dumps(list(prompts)).encode()), dtype=torch.uint8)
    return zlib.compress(save({"frames": x.contiguous(), "prompts": text}), 1)  # level 1: the network is the budget


class BodyTooLarge(ValueError):
    """A request body that decompresses, or decodes, to more than the server takes (the server answers 413)."""


# safetensors' names of the dtypes a body may hold: float frames travel as they are, uint8 ones become float32
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8}
_INFLATE_STEP = 8 << 20  # the most bytes one zlib call inflates: the GIL is held for one step's copy only
_INPUT_STEP = 1 << 20  # compressed bytes handed to zlib at a time
_MAX_PROMPT_BYTES = 64 << 20  # the prompts' JSON: thousands of long prompts fit


class _Inflater:
    """Inflates a zlib body in steps of at most `_INFLATE_STEP` bytes, straight into the caller's buffers: nothing
    is inflated that was not asked for, so a bomb is refused after its first step, never held whole."""

    def __init__(self, body: bytes | bytearray):
        self.z, self.rest = zlib.decompressobj(), memoryview(body)

    def read_into(self, out: memoryview) -> None:
        """Fill ``out`` with the next len(out) inflated bytes; ValueError when the body ends first."""
        pos = 0
        while pos < len(out):
            data = self.z.unconsumed_tail
            if not data:
                data, self.rest = self.rest[:_INPUT_STEP], self.rest[_INPUT_STEP:]
            if not data or self.z.eof:
                raise ValueError("malformed request body (it ends before the tensors its header announces)")
            try:
                chunk = self.z.decompress(data, min(len(out) - pos, _INFLATE_STEP))
            except zlib.error as err:
                raise ValueError(f"malformed request body (zlib: {err})") from None
            out[pos : pos + len(chunk)] = chunk
            pos += len(chunk)


def decode_batch(body: bytes | bytearray, max_bytes: int = MAX_BODY_BYTES) -> tuple[torch.Tensor, list[str]]:
    """The inverse of `encode_batch` -> (frames float32, or the sent float dtype; prompts). Raises `BodyTooLarge`
    when the body decodes to more than ``max_bytes``: the decompressed bytes, plus the float32 copy of uint8 frames
    (float frames are a view of the decompressed bytes, no copy). The sizes come from the safetensors header, checked
    before the tensors are inflated, and the body is inflated in steps (a zlib bomb stops at its header), so a
    request never holds more than its body and ``max_bytes``. ValueError on anything malformed (the server answers
    400). Parsed here rather than by safetensors' `load`, which would copy every tensor once more, holding the GIL."""
    inflater = _Inflater(body)
    head = bytearray(8)
    inflater.read_into(memoryview(head))
    n = int.from_bytes(head, "little")  # the JSON header's length
    if n > 100_000_000:  # safetensors' own limit on a header: not a safetensors body (a pickle, say), a 400
        raise ValueError(f"malformed request body (a safetensors header of {n} bytes)")
    if 8 + n > max_bytes:
        raise BodyTooLarge(f"request body decompresses to more than the server's limit of {max_bytes} bytes")
    header = bytearray(n)
    inflater.read_into(memoryview(header))
    try:
        meta = json.loads(bytes(header))
        metas = {k: meta[k] for k in ("frames", "prompts")}
        dtypes = {k: _DTYPES[m["dtype"]] if m["dtype"] in _DTYPES else m["dtype"] for k, m in metas.items()}
        shapes = {k: [int(d) for d in m["shape"]] for k, m in metas.items()}
        spans = {k: (int(m["data_offsets"][0]), int(m["data_offsets"][1])) for k, m in metas.items()}
    except Exception as err:  # noqa: BLE001 - whatever a client sent: a 400, never a crash
        raise ValueError(f"malformed request body (header: {type(err).__name__}: {err})") from None
    if not isinstance(dtypes["frames"], torch.dtype):
        raise ValueError(f"frames must be float or uint8, got {dtypes['frames']}")
    if dtypes["prompts"] != torch.uint8 or len(shapes["prompts"]) != 1:
        raise ValueError("malformed request body (prompts must be uint8 bytes)")
    if shapes["prompts"][0] > _MAX_PROMPT_BYTES:  # parsed holding the GIL: a GiB of "prompts" would stall /health
        raise BodyTooLarge(f"request prompts of {shapes['prompts'][0]} bytes, more than the server's limit of "
                           f"{_MAX_PROMPT_BYTES}")
    numel = {k: math.prod(s) for k, s in shapes.items()}
    for k, (lo, hi) in spans.items():
        if any(d < 0 for d in shapes[k]) or not 0 <= lo <= hi or hi - lo != numel[k] * dtypes[k].itemsize:
            raise ValueError(f"malformed request body ({k}: shape {shapes[k]}, bytes {lo}..{hi})")
    size = max(hi for _, hi in spans.values())
    if 8 + n + size > max_bytes:
        raise BodyTooLarge(f"request body decompresses to more than the server's limit of {max_bytes} bytes")
    decoded = 8 + n + size + (numel["frames"] * 4 if dtypes["frames"] == torch.uint8 else 0)
    if decoded > max_bytes:
        raise BodyTooLarge(f"request body decodes to {decoded} bytes (its uint8 frames as float32), more than the "
                           f"server's limit of {max_bytes} bytes")
    # torch.empty, not bytearray(size): that zero-fills the whole buffer while it holds the GIL (seconds a GiB)
    data = torch.empty(size, dtype=torch.uint8)
    inflater.read_into(memoryview(data.numpy()))
    lo, hi = spans["prompts"]
    try:
        prompts = json.loads(data[lo:hi].numpy().tobytes().decode())
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"malformed request body (prompts: {type(err).__name__}: {err})") from None
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a list of strings")
    lo, hi = spans["frames"]
    frames = data[lo:hi]
    if lo % dtypes["frames"].itemsize:  # a view as a wider dtype needs an aligned start (safetensors aligns it)
        frames = frames.clone()
    frames = frames.view(dtypes["frames"]).view(shapes["frames"])  # a view of `data`: no copy
    if frames.ndim < 1 or frames.shape[0] != len(prompts):
        raise ValueError(f"{tuple(frames.shape)} frames for {len(prompts)} prompts")
    if frames.dtype == torch.uint8:
        frames = frames.float()  # `data` goes when this returns: the float32 copy was counted in its place
    return frames, prompts


# ------------------------------------------------------------------------------------------------ the client


class _Deadline:
    """When the calling thread's current try must be over: set when the try is sent (the client's request hook), so
    that every socket operation of that try (connect, TLS, writes, the headers and the body read) waits at most until
    then. Per thread: a client's threads each wait on their own request."""

    def __init__(self, seconds: float):
        self.seconds, self._local = float(seconds), threading.local()

    def start(self, request) -> None:
        self._local.at = time.monotonic() + self.seconds

    def left(self, timeout: float | None, expired: type[Exception]) -> float | None:
        """The wait for the next socket operation: ``timeout`` (httpx's, per operation) or less, down to what is left
        of this try; ``expired`` once nothing is left."""
        at = getattr(self._local, "at", None)
        if at is None:
            return timeout
        left = at - time.monotonic()
        if left <= 0:
            raise expired(f"the request was not over {self.seconds:g} s after it was sent")
        return left if timeout is None else min(timeout, left)


_WRITE_STEP = 1 << 20  # a write waits on the deadline again after this many bytes (a body of GiBs drained slowly)


class _DeadlineStream:
    """An httpcore network stream whose every operation ends by the try's deadline."""

    def __init__(self, stream, deadline: _Deadline):
        self.stream, self.deadline = stream, deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        import httpcore

        return self.stream.read(max_bytes, self.deadline.left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        import httpcore

        view = memoryview(buffer)
        for i in range(0, len(view), _WRITE_STEP):
            self.stream.write(view[i : i + _WRITE_STEP], self.deadline.left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self.stream.close()

    def start_tls(self, ssl_context, server_hostname: str | None = None, timeout: float | None = None):
        import httpcore

        tls = self.stream.start_tls(ssl_context, server_hostname, self.deadline.left(timeout, httpcore.ConnectTimeout))
        return _DeadlineStream(tls, self.deadline)

    def get_extra_info(self, info: str):
        return self.stream.get_extra_info(info)


class _DeadlineBackend:
    """An httpcore network backend whose connections end each operation by the try's deadline."""

    def __init__(self, backend, deadline: _Deadline):
        self.backend, self.deadline = backend, deadline

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        import httpcore

        stream = self.backend.connect_tcp(host, port, self.deadline.left(timeout, httpcore.ConnectTimeout),
                                          local_address, socket_options)
        return _DeadlineStream(stream, self.deadline)

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        import httpcore

        stream = self.backend.connect_unix_socket(path, self.deadline.left(timeout, httpcore.ConnectTimeout),
                                                  socket_options)
        return _DeadlineStream(stream, self.deadline)

    def sleep(self, seconds: float) -> None:
        self.backend.sleep(seconds)


def deadline_client(timeout: float, **kwargs):
    """An httpx.Client (``kwargs`` as httpx's) each of whose tries ends ``timeout`` seconds after it was sent, from
    the connection to the body's last byte. httpx's own timeouts are per socket operation, so a server writing a
    byte at a time (headers or body) would hold a request for as long as it likes; here every operation waits at
    most until the try's deadline, and one that starts after it raises httpx's timeout of that operation (retried
    as any timeout). The proxies httpx takes from the environment keep working: their connections are bounded too."""
    import httpx

    deadline = _Deadline(timeout)
    client = httpx.Client(timeout=httpx.Timeout(timeout), event_hooks={"request": [deadline.start]}, **kwargs)
    # httpx has no public hook for the network backend: each transport's connection pool holds its own
    for transport in (client._transport, *client._mounts.values()):
        pool = getattr(transport, "_pool", None)
        if transport is not None and not hasattr(pool, "_network_backend"):
            raise RuntimeError(f"httpx {httpx.__version__}: a transport without a connection pool's network "
                               "backend; --reward_timeout cannot bound a whole request")
        if pool is not None:
            pool._network_backend = _DeadlineBackend(pool._network_backend, deadline)
    return client


def _detail(r) -> str:
    """The reason a server gave with an error answer (FastAPI's ``detail``), else the start of its text."""
    try:
        text = str(r.json()["detail"])
    except Exception:  # noqa: BLE001 - not JSON, or no detail: whatever it sent
        text = r.text
    return " ".join(text.split())[:300]


@dataclass
class _Server:
    """One reward served by one or more replicas."""

    urls: list[str]
    components: tuple[str, ...]
    default_weights: dict[str, float]
    version: str
    read_spec: dict | None
    settings: dict  # the server's reward flags that change the scores

    def difference(self, other: _Server) -> str:
        """What tells ``other`` apart from this server, in words (nothing when they are replicas)."""
        if self.components != other.components:
            return f"components {', '.join(self.components)} vs {', '.join(other.components)}"
        if self.version != other.version:
            return f"version {self.version!r} vs {other.version!r}"
        keys = sorted(set(self.settings) | set(other.settings))
        diff = [f"{k} {self.settings.get(k)!r} vs {other.settings.get(k)!r}" for k in keys
                if self.settings.get(k) != other.settings.get(k)]
        if self.read_spec != other.read_spec:
            diff.append(f"read_spec {self.read_spec!r} vs {other.read_spec!r}")
        return ", ".join(diff)


class RemoteReward:
    """`Reward` whose components are computed by reward servers; see the module docstring."""

    runs_on_cpu = True  # it encodes CPU frames and waits on the network: the overlap scores it in a worker thread

    def __init__(self, urls: Sequence[str], timeout: float = 120.0, retries: int = 3, backoff: float = 1.0,
                 token: str | None = None, rank: int = 0, video_fps: float | None = None, batch_size: int = 0):
        """``urls``: server base URLs; ``timeout``: seconds per request; ``retries``: further tries after the first;
        ``backoff``: seconds before the first retry (doubled each time); ``token``: bearer token (default: the
        ``SAGE_REWARD_TOKEN`` environment variable); ``rank``: spreads ranks over replicas; ``video_fps``: the frame
        rate of the videos this client sends, checked against a server that samples frames by time; ``batch_size``:
        the most videos one request holds (``--reward_batch_size``), 0 = all videos of a call."""
        urls = [u.strip().rstrip("/") for u in urls if u.strip()]
        if not urls:
            raise SageGRPOError("--reward_model remote needs --reward_url (the server's http://host:port, several "
                                "separated by commas)")
        self.timeout, self.retries, self.backoff, self.rank = float(timeout), int(retries), float(backoff), rank
        self.batch_size = int(batch_size)
        token = os.environ.get(TOKEN_ENV, "") if token is None else token
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = deadline_client(self.timeout, headers=self.headers)
        self._calls = 0
        groups: dict[tuple, _Server] = {}
        for url in urls:
            info = self._info(url)
            settings = dict(info.get("settings") or {})
            key = (tuple(info["components"]), info["version"], json.dumps(settings, sort_keys=True),
                   json.dumps(info.get("read_spec"), sort_keys=True))
            if key in groups:
                groups[key].urls.append(url)
            else:
                groups[key] = _Server([url], tuple(info["components"]), dict(info["default_weights"]),
                                      info["version"], info.get("read_spec"), settings)
        self.servers = list(groups.values())
        for srv in self.servers:
            frames = (srv.read_spec or {}).get("frames") or {}
            if video_fps is not None and "video_fps" in frames and float(frames["video_fps"]) != float(video_fps):
                raise SageGRPOError(f"reward server {srv.urls[0]} samples frames as if videos had "
                                    f"{frames['video_fps']:g} fps, but these have {video_fps:g}: restart it with "
                                    f"--video_fps {video_fps:g}")
        comps: list[str] = []
        for i, s in enumerate(self.servers):
            for other in self.servers[:i]:
                clash = [c for c in s.components if c in other.components]
                if clash:
                    raise SageGRPOError(f"--reward_url: {other.urls[0]} and {s.urls[0]} both serve {clash[0]!r} but "
                                        f"are not replicas ({other.difference(s)}): start replicas with the same "
                                        "reward and reward flags")
            comps += s.components
        self.components = tuple(comps)
        self.default_weights = {k: v for s in self.servers for k, v in s.default_weights.items()}

    def _info(self, url: str) -> dict:
        """GET /info, with the same retries as scoring; one SageGRPOError line when it cannot be had."""
        import httpx

        err: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                r = self.client.get(f"{url}/info")
                if r.status_code in (401, 403):
                    raise SageGRPOError(f"reward server {url} refused the token ({r.status_code}): set {TOKEN_ENV} "
                                        "to the server's token")
                r.raise_for_status()
                info = r.json()
                if not info.get("components"):
                    raise SageGRPOError(f"{url}/info is not a reward server's answer: {str(info)[:200]}")
                return info
            except (httpx.HTTPError, ValueError) as e:
                err = e
                if attempt < self.retries:
                    time.sleep(self.backoff * 2**attempt)
        if isinstance(err, httpx.HTTPStatusError):  # it answers, but not as a server that scores (a stopped batcher)
            raise SageGRPOError(f"reward server {url} answered {err.response.status_code} to /info "
                                f"({_detail(err.response)}); restart it (python scripts/serve_reward.py), or leave it "
                                "out of --reward_url") from None
        raise SageGRPOError(f"reward server {url} cannot be reached ({type(err).__name__}: {_one_line(err)}); start "
                            "it with "
                            "python scripts/serve_reward.py, or check --reward_url") from None

    def health(self) -> list[dict]:
        """GET /health of every URL (for scripts and tests)."""
        return [self.client.get(f"{u}/health").json() for s in self.servers for u in s.urls]

    def _score(self, server: _Server, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """One server's components for the batch, in requests of at most ``batch_size`` videos (a body over the
        server's limit is refused whole, so fewer videos per request is what makes it fit)."""
        n = videos.shape[0]
        step = self.batch_size if self.batch_size > 0 else max(n, 1)
        parts = [self._post(server, videos[i : i + step], prompts[i : i + step]) for i in range(0, max(n, 1), step)]
        return {c: torch.cat([p[c] for p in parts]) for c in server.components}  # each [n]

    def _post(self, server: _Server, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """One request's components, NaN when every try failed."""
        n = videos.shape[0]
        x = apply_read(server.read_spec, videos)
        body = encode_batch(x, prompts, wire_dtype(server.read_spec))
        start = (self.rank + self._calls) % len(server.urls)
        errors = []
        for attempt in range(self.retries + 1):
            url = server.urls[(start + attempt) % len(server.urls)]
            try:
                r = self.client.post(f"{url}/score", content=body, headers={"Content-Type": CONTENT_TYPE})
                if r.status_code in (401, 403):  # a token changed mid-run: retrying cannot help
                    errors.append(f"{url}: token refused ({r.status_code})")
                    break
                if r.status_code == 413:  # the same body is as large on every try
                    errors.append(f"{url}: body too large (413: {_detail(r)}); lower --reward_batch_size or raise "
                                  "the server's --max_request_mb")
                    break
                r.raise_for_status()
                scores = r.json()["scores"]
                out = {}
                for c in server.components:
                    vals = scores[c]
                    if len(vals) != n:
                        raise ValueError(f"{c!r} has {len(vals)} scores for {n} videos")
                    out[c] = torch.tensor([math.nan if v is None else float(v) for v in vals], dtype=torch.float32)
                return {c: v.to(videos.device) for c, v in out.items()}
            except Exception as e:  # noqa: BLE001 - network, server and answer errors all end as a retry, then NaN
                errors.append(f"{url}: {type(e).__name__}: {_one_line(e)}")
                if attempt < self.retries:
                    time.sleep(self.backoff * 2**attempt)
        warnings.warn(f"reward server failed {len(errors)} time(s) on a batch of {n} ({errors[-1]}); its scores are "
                      "NaN", RuntimeWarning, stacklevel=4)
        return {c: torch.full((n,), math.nan, dtype=torch.float32, device=videos.device) for c in server.components}

    def __call__(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score float [B, F, 3, H, W] in [0, 1] -> {component: float32 [B]} (NaN where the servers failed)."""
        out: dict[str, torch.Tensor] = {}
        for s in self.servers:
            out.update(self._score(s, videos, prompts))
        self._calls += 1
        return out


@register_reward("remote")
def build_remote(reward_url: str | Sequence[str] = "", reward_timeout: float = 120.0, reward_retries: int = 3,
                 reward_backoff: float = 1.0, video_fps: float | None = None, batch_size: int = 0,
                 **_: object) -> RemoteReward:
    """Builder of the remote reward (``reward_url``: comma-separated URLs; ``batch_size``: most videos per
    request)."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise SageGRPOError("--reward_model remote needs httpx: pip install 'sage-grpo[remote]'") from None
    urls = reward_url.split(",") if isinstance(reward_url, str) else list(reward_url)
    rank = int(os.environ.get("RANK", "0"))
    return RemoteReward(urls, timeout=reward_timeout, retries=reward_retries, backoff=reward_backoff, rank=rank,
                        video_fps=video_fps, batch_size=batch_size)
