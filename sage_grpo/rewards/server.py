"""The reward server behind `scripts/serve_reward.py`: a FastAPI app that scores with any reward.

Endpoints: ``GET /health`` (no token: for load balancers and start-up scripts; counts of requests and batches;
503 once the batcher has stopped, when /info and /score answer 503 with the reason at once too),
``GET /info`` (components, default weights, version, settings, ``read_spec``: what `RemoteReward` needs to know) and
``POST /score`` (a body of `sage_grpo.rewards.remote.encode_batch`; answers ``{"scores": {component: [B]}}``,
null for NaN). Requests that arrive while a batch is scored, or within ``batch_wait_s`` of the first, are scored
together (up to ``max_batch`` videos of one shape) by one worker thread, so the model sees one batch at a time.
When ``token`` is set, /info and /score need ``Authorization: Bearer <token>``. No request body is ever unpickled.
A body longer than ``max_body_bytes`` is refused (413) before it is read, or as soon as it grows past the limit
while it streams in; one that decodes to more (the decompressed bytes plus the float32 copy of uint8 frames) once
its header is read, before the tensors are inflated. It is inflated in steps and decoded in a worker thread, so
/health answers while a large body is decoded (in 50 ms at most during a 2 GiB one, which takes seconds).
"""

from __future__ import annotations

import asyncio
import hmac
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from fastapi import FastAPI, HTTPException, Request  # at module level: FastAPI resolves the handlers' annotations here
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from sage_grpo.rewards.base import score_safely
from sage_grpo.rewards.remote import MAX_BODY_BYTES, BodyTooLarge, decode_batch, read_spec_of

__all__ = ["make_app"]


class _ReadScorer:
    """`score_read` seen as a reward: what `score_safely` calls on the frames a client already reduced."""

    def __init__(self, reward):
        self.reward, self.components = reward, tuple(reward.components)

    def __call__(self, x: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        return self.reward.score_read(x, prompts)


class BatcherStopped(RuntimeError):
    """The batcher is gone: this server will score nothing more (answered 503, so that clients go elsewhere)."""


class Batcher:
    """Collects concurrent requests into batches for one scoring thread."""

    def __init__(self, score, max_batch: int, wait_s: float):
        """``score(frames [B, ...], prompts) -> {component: [B]}``."""
        self.score, self.max_batch, self.wait_s = score, max_batch, wait_s
        self.queue: asyncio.Queue | None = None
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="reward")  # one model, one batch at a time
        self.requests = self.batches = self.videos = 0
        self.error = ""  # why `run` ended; "" while it runs
        self.closing = False  # the server shuts down: `run` is cancelled on purpose

    async def submit(self, frames: torch.Tensor, prompts: list[str]) -> dict[str, list]:
        if self.error:
            raise BatcherStopped(self.error)
        fut = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((frames, prompts, fut))
        return await fut

    async def run(self) -> None:
        """Score batches until cancelled. Whatever else ends the loop (a reward raising a BaseException that is
        no Exception, such as a CancelledError of its own) is kept in ``error``, and every waiting request and
        every later one is answered with it at once instead of waiting for ever."""
        loop = asyncio.get_running_loop()
        batch: list = []
        try:
            while True:
                batch = [await self.queue.get()]
                n = batch[0][0].shape[0]
                deadline = loop.time() + self.wait_s
                while n < self.max_batch:
                    # whatever else is queued, then what arrives before the deadline
                    try:
                        item = self.queue.get_nowait() if not self.queue.empty() else await asyncio.wait_for(
                            self.queue.get(), max(0.0, deadline - loop.time()))
                    except (asyncio.TimeoutError, TimeoutError):
                        break
                    batch.append(item)
                    n += item[0].shape[0]
                by_shape: dict[tuple, list] = {}
                for item in batch:  # only frames of one shape and dtype can share a tensor
                    by_shape.setdefault((tuple(item[0].shape[1:]), item[0].dtype), []).append(item)
                for items in by_shape.values():
                    await self._score(loop, items)
        except BaseException as err:  # noqa: BLE001 - see the docstring
            self.error = f"the reward server's batcher stopped ({type(err).__name__}: {err})"
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_exception(BatcherStopped(self.error))
            if self.closing:
                raise

    def _score_frames(self, frames: list[torch.Tensor], prompts: list[str]) -> list[dict[str, list]]:
        """In the scoring thread: one batch -> each request's {component: [scores]}, None for NaN."""
        scores = self.score(torch.cat(frames), prompts)
        out, lo = [], 0
        for f in frames:
            hi = lo + f.shape[0]
            out.append({c: [None if math.isnan(v) else v for v in s[lo:hi].tolist()] for c, s in scores.items()})
            lo = hi
        return out

    async def _score(self, loop, items: list) -> None:
        prompts = [p for _, ps, _ in items for p in ps]
        self.requests += len(items)
        self.batches += 1
        self.videos += len(prompts)
        try:
            answers = await loop.run_in_executor(self.executor, self._score_frames, [f for f, _, _ in items],
                                                 prompts)
        except Exception as err:  # noqa: BLE001 - answered as a 500 to each waiting request
            for _, _, fut in items:
                if not fut.done():
                    fut.set_exception(err)
            return
        for (_, _, fut), answer in zip(items, answers):
            if not fut.done():  # the client may have gone (timeout)
                fut.set_result(answer)


async def read_body(request: Request, limit: int) -> bytearray:
    """The request body, refused with 413 when it announces more than ``limit`` bytes (before any of it is read)
    or grows past it (a chunked body, or one longer than announced): never more than ``limit`` bytes are held."""
    announced = request.headers.get("content-length", "")
    if announced.isdigit() and int(announced) > limit:
        raise HTTPException(status_code=413, detail=f"request body of {announced} bytes is larger than the server's "
                                                    f"limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > limit:
            raise HTTPException(status_code=413, detail=f"request body larger than the server's limit of {limit} "
                                                        "bytes")
        body += chunk
    return body


def make_app(reward, name: str, version: str, *, settings: dict | None = None, token: str = "", max_batch: int = 16,
             batch_wait_s: float = 0.01, device: str | torch.device = "cpu", max_body_bytes: int = MAX_BODY_BYTES):
    """The FastAPI app serving ``reward`` (a `Reward`, or a `CompositeReward` of one or more) as ``name``;
    ``settings``: the reward's flags that change its scores (JSON-able; clients take only servers that report the
    same ones, version and components as replicas); ``max_body_bytes``: the largest request body, compressed and
    decoded (see `decode_batch`)."""
    from contextlib import asynccontextmanager

    rewards = list(getattr(reward, "rewards", {"": reward}).values())
    # a reward that says what it reads gets only that from clients (one reward per server: a composite's parts
    # could read different frames, so it gets whole videos)
    single = rewards[0] if len(rewards) == 1 else None
    spec = read_spec_of(single) if single is not None else None
    scorer = _ReadScorer(single) if spec is not None else None
    components = tuple(c for r in rewards for c in r.components)
    default_weights = {k: v for r in rewards for k, v in r.default_weights.items()}
    device = torch.device(device)

    def score(frames: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        frames = frames.to(device)
        out: dict[str, torch.Tensor] = {}
        for r in rewards:
            out.update(score_safely(scorer if scorer is not None else r, frames, prompts))
        return {c: out[c].float().cpu() for c in components}

    batcher = Batcher(score, max_batch, batch_wait_s)

    @asynccontextmanager
    async def lifespan(app):
        batcher.queue = asyncio.Queue()
        task = asyncio.create_task(batcher.run())
        yield
        batcher.closing = True
        task.cancel()
        batcher.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title=f"sage-grpo reward server: {name}", lifespan=lifespan)

    def authorize(request: Request) -> None:
        if not token:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    @app.get("/health")
    async def health():
        counts = {"reward": name, "requests": batcher.requests, "batches": batcher.batches, "videos": batcher.videos}
        if batcher.error:  # a load balancer or supervisor takes this server out
            return JSONResponse(status_code=503, content={"status": "failed", "error": batcher.error, **counts})
        return {"status": "ok", **counts}

    @app.get("/info")
    async def info(request: Request):
        authorize(request)
        if batcher.error:  # a client starting now must not take this server as a replica: it scores nothing more
            return JSONResponse(status_code=503, content={"detail": batcher.error})
        return {"reward": name, "components": list(components), "default_weights": default_weights,
                "version": version, "settings": settings or {}, "read_spec": spec, "max_batch": max_batch,
                "max_body_bytes": max_body_bytes}

    @app.post("/score")
    async def score_endpoint(request: Request):
        authorize(request)
        if batcher.error:  # at once, before the body is read
            return JSONResponse(status_code=503, content={"detail": batcher.error})
        body = await read_body(request, max_body_bytes)
        try:  # in a worker thread: decompressing and decoding a large body takes seconds
            frames, prompts = await run_in_threadpool(decode_batch, body, max_body_bytes)
            del body  # not held while the batch waits and is scored
        except BodyTooLarge as err:
            raise HTTPException(status_code=413, detail=str(err)) from None
        except ValueError as err:
            raise HTTPException(status_code=400, detail=str(err)) from None
        if spec is None and (frames.ndim != 5 or frames.shape[2] != 3):
            raise HTTPException(status_code=400, detail=f"expected videos [B, F, 3, H, W], got {tuple(frames.shape)}")
        try:
            scores = await batcher.submit(frames, prompts)
        except BatcherStopped as err:
            return JSONResponse(status_code=503, content={"detail": str(err)})
        except Exception as err:  # noqa: BLE001
            return JSONResponse(status_code=500, content={"detail": f"{type(err).__name__}: {err}"})
        return {"scores": scores}

    return app
