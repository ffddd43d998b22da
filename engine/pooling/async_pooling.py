"""AsyncPoolingEngine: the server's side of the pooling runner. Handlers queue their inputs; the engine thread
packs queued inputs of any number of requests into forwards of up to the token budget, and hands each request
its vectors back through its event loop. Same surface as AsyncEngine where the server needs one (admission
counts, drain, shutdown, the tokenizer thread)."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, TypeVar

from pagekube.engine.async_engine import EngineThread
from pagekube.engine.errors import EngineDeadError

if TYPE_CHECKING:
    import torch

    from pagekube.engine.pooling.pooling_engine import PoolingEngine

log = logging.getLogger("pagekube.engine")
T = TypeVar("T")


class EmbeddingJob:
    """One API request's inputs on their way through the engine thread; its times feed metrics and the log."""

    def __init__(self, request_id: str, prompts: list[list[int]], loop: asyncio.AbstractEventLoop):
        self.request_id, self.prompts, self.loop = request_id, prompts, loop
        self.future: asyncio.Future = loop.create_future()
        self.results: list[torch.Tensor | None] = [None] * len(prompts)
        self.remaining = len(prompts)
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.finished_time: float | None = None
        self.finish_reason = "stop"

    def settle(self, outcome) -> None:
        """Resolve the handler's future from the engine thread (an exception, or the vectors)."""
        def resolve(fut: asyncio.Future):
            if not fut.done():
                fut.set_exception(outcome) if isinstance(outcome, BaseException) else fut.set_result(outcome)
        self.loop.call_soon_threadsafe(resolve, self.future)


class AsyncPoolingEngine:
    def __init__(self, engine: PoolingEngine, engine_thread: EngineThread | None = None):
        self.engine = engine
        self._queue: deque[tuple[EmbeddingJob, int]] = deque()  # (job, input index), in arrival order
        self._jobs: set[EmbeddingJob] = set()
        self._cond = threading.Condition()
        self._admitted = 0
        self._stop = False
        self.dead: BaseException | None = None
        self.running = 0  # inputs in the forward now running
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._loop_done = (engine_thread or EngineThread()).submit(self._run)

    # ---- API for request handlers --------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        with self._cond:
            return len(self._jobs)

    def num_waiting(self) -> int:
        """Inputs queued for a forward, plus requests admitted and still tokenizing (vllm:num_requests_waiting)."""
        with self._cond:
            return len(self._queue) + self._admitted

    def reserve(self) -> None:
        with self._cond:
            self._admitted += 1

    def release(self) -> None:
        with self._cond:
            self._admitted -= 1

    async def run_tokenizer(self, fn: Callable[..., T], *args) -> T:
        """Tokenizing, and encoding responses: on the tokenizer thread, never on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, functools.partial(fn, *args))

    async def embed(self, prompts: list[list[int]], request_id: str) -> EmbeddingJob:
        """Queue the inputs and wait for their pooled vectors (job.results, in input order)."""
        job = EmbeddingJob(request_id, prompts, asyncio.get_running_loop())
        with self._cond:
            if self.dead is not None:
                raise EngineDeadError(f"the engine loop has stopped: {self.dead}")
            self._jobs.add(job)
            self._queue.extend((job, i) for i in range(len(prompts)))
            self._cond.notify()
        try:
            await job.future
        except asyncio.CancelledError:  # the handler is gone: its inputs not yet run are dropped
            self._drop(job, "abort")
            raise
        return job

    def abort_all(self) -> None:
        """Fail every request not yet finished (the drain deadline); a forward already running completes."""
        with self._cond:
            jobs = list(self._jobs)
        for job in jobs:
            self._drop(job, "abort")
            job.settle(EngineDeadError("aborted: the server is shutting down"))

    def shutdown(self, timeout: float = 10) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        try:
            self._loop_done.result(timeout=timeout)
        except FutureTimeout:
            log.warning("the pooling loop did not stop within %.0f s", timeout)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    def _drop(self, job: EmbeddingJob, reason: str) -> None:
        with self._cond:
            if job not in self._jobs:
                return
            self._jobs.discard(job)
            self._queue = deque(item for item in self._queue if item[0] is not job)
        job.finish_reason = reason
        job.finished_time = time.monotonic()
        for listener in self.engine.stat_listeners:
            listener.on_pooled_request(job)

    # ---- the engine thread ---------------------------------------------------------------------------------
    def _take(self) -> list[tuple[EmbeddingJob, int]]:
        """The next forward: queued inputs in order, up to the token budget (the first one always fits)."""
        budget = self.engine.max_num_batched_tokens
        with self._cond:
            while not self._queue and not self._stop:
                self._cond.wait(0.5)
            batch, tokens = [], 0
            while self._queue and not self._stop:
                job, i = self._queue[0]
                n = len(job.prompts[i])
                if batch and tokens + n > budget:
                    break
                self._queue.popleft()
                batch.append((job, i))
                tokens += n
            self.running = len(batch)
            return batch

    def _run(self) -> None:
        try:
            while not self._stop:
                batch = self._take()
                if not batch:
                    continue
                now = time.monotonic()
                for job, _ in batch:
                    job.first_scheduled_time = job.first_scheduled_time or now
                pooled = self.engine.embed_batch([job.prompts[i] for job, i in batch])
                for listener in self.engine.stat_listeners:
                    listener.on_pooling_iteration(self, sum(len(job.prompts[i]) for job, i in batch))
                for (job, i), row in zip(batch, pooled):
                    job.results[i] = row
                    job.remaining -= 1
                    if job.remaining == 0:
                        self._finish(job)
                self.running = 0
        except BaseException as e:  # noqa: BLE001 - every waiting request must hear about it
            log.exception("pooling loop died")
            with self._cond:
                self.dead = e
                jobs = list(self._jobs)
                self._jobs.clear()
                self._queue.clear()
            for job in jobs:
                job.settle(EngineDeadError(f"engine loop died: {e}"))

    def _finish(self, job: EmbeddingJob) -> None:
        with self._cond:
            if job not in self._jobs:  # dropped (client gone, drain deadline) while its forward ran
                return
            self._jobs.discard(job)
        job.finished_time = time.monotonic()
        for listener in self.engine.stat_listeners:
            listener.on_pooled_request(job)
        job.settle(job.results)
