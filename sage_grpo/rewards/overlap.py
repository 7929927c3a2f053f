"""Scores of the rollout's chunks while the rollout goes on (`--reward_overlap`): post_train.py hands each finished
chunk of --mini_batch_size_per_update videos to `EarlyScores`, which decodes it and has a worker thread score it
on the CPU, and collects every chunk's scores after the rollout (docs/rewards.md)."""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sage_grpo.parallel.dist import DistInfo

__all__ = ["EarlyScores"]


class EarlyScores:
    """Scores of the rollout's chunks, asked for as each chunk finishes: the chunk is decoded here (the accelerator
    is this thread's) and scored on the CPU by the reward in a worker thread, while the rollout goes on with the next
    chunk. The sp peers hold the same videos: video i of the rank is decoded and scored by sp rank i % sp_size only
    (every chunk of >= sp videos is shared evenly, chunks of one video take turns), and `collect` gathers the
    scores in the sp group. Decoding and scoring run no collective, so every sp rank makes the same transformer
    forwards. `collect` -> the scores of all videos in rollout order, as the in-order scoring gives them.
    `reward`: the run's reward (called in the worker thread); `info`: the rank's DistInfo; `vae`: decodes the chunks.

    Used as a context manager: when the rollout or the reward phase raises, the chunks not yet scored are cancelled
    and the worker is left behind without a wait. It is a daemon thread, not a ThreadPoolExecutor's: those are
    joined when the interpreter exits, so a reward blocked for ever (a hung judge or server) would hold the failed
    run's process for ever; a daemon thread is not waited for."""

    def __init__(self, reward, info: DistInfo, vae):
        import queue

        self.reward, self.info, self.vae = reward, info, vae
        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # (future, frames, prompts), None = no more
        self.worker = threading.Thread(target=self._work, name="reward_0", daemon=True)  # chunks scored in order
        self.worker.start()
        self.futures: list = []
        self.rows: list[list[int]] = []  # the rank's videos each future scores
        self.prompts: list[str] = []
        self.closed = False

    def __enter__(self) -> EarlyScores:
        return self

    def __exit__(self, kind, err, tb) -> None:
        if kind is not None:  # the step failed: nothing waits for what is queued or running
            self.close(cancel=True)

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            future, frames, prompts = item
            if not future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            try:
                future.set_result(self.reward(frames, prompts))
            except BaseException as err:  # noqa: BLE001 - handed to `collect`, as a ThreadPoolExecutor would
                future.set_exception(err)

    def close(self, cancel: bool = False) -> None:
        """Let the worker end once what is queued is done (`cancel`: cancel what has not started and drop its frames;
        the running chunk, if any, is not waited for). Once; later calls do nothing."""
        import queue

        if self.closed:
            return
        self.closed = True
        if cancel:
            for f in self.futures:
                f.cancel()
            try:  # the frames of the cancelled chunks are not held by a worker that may never come back
                while True:
                    self.queue.get_nowait()
            except queue.Empty:
                pass
        self.queue.put(None)

    def start(self, prompts: list[str]) -> None:
        self.prompts = list(prompts)

    def submit(self, indices: torch.Tensor, final_latents: torch.Tensor) -> None:
        """A finished chunk: indices [n] into the rank's videos, final latents [n, C, F, H, W]."""
        from sage_grpo.rollout import decode_latents

        info = self.info
        mine = (indices % info.sp_size == info.sp_rank).cpu()  # [n] bool: the videos this sp rank scores
        if not mine.any():
            return
        rows = indices.cpu()[mine].tolist()
        frames = decode_latents(self.vae, final_latents[mine.to(final_latents.device)])  # [m, F, 3, H, W]
        from concurrent.futures import Future

        future: Future = Future()
        self.rows.append(rows)
        self.futures.append(future)
        self.queue.put((future, frames.cpu(), [self.prompts[i] for i in rows]))

    def collect(self, names: list[str], b: int) -> torch.Tensor:
        """-> [b, K] scores of the rank's b videos (columns `names`), every chunk's, in rollout order."""
        from sage_grpo.parallel.dist import all_gather_cat

        info = self.info
        try:
            parts = [f.result() for f in self.futures]
        except BaseException:  # a chunk's reward raised: the later chunks are not waited for either
            self.close(cancel=True)
            raise
        self.close()  # every chunk is scored: the worker ends at once
        mine = torch.full((b, len(names)), math.nan, device=info.device)  # [b, K], NaN = another sp rank's video
        for rows, scores in zip(self.rows, parts):
            mine[rows] = torch.stack([scores[k].float().to(info.device) for k in names], dim=1)
        if info.sp_size == 1:
            return mine
        every = all_gather_cat(mine[None], group=info.sp_group)  # [sp, b, K]
        videos = torch.arange(b, device=info.device)
        return every[videos % info.sp_size, videos]  # [b, K]: each video's row from the rank that scored it
