"""AsyncEngine: steps the LLMEngine on a background thread; each request gets an async stream of outputs.

The engine itself is touched only by its thread. Other threads hand it commands through a queue (add, abort) and
get outputs back through their event loop (call_soon_threadsafe), so a slow client never stalls the batch.
Tokenization and chat templating run on one tokenizer thread, never on the event loop: a long prompt must not
stall every other stream's chunks (HF fast tokenizers release the GIL). Outputs are made into text on one
detokenizer thread (engine/text_outputs.py: detokenization, stop strings, the output kind), never on the engine
thread, which only schedules, runs the model and samples.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin TimeoutError before 3.11
from typing import TYPE_CHECKING, TypeVar

from pagekube.engine.errors import EngineDeadError, WorkerDied
from pagekube.engine.lora.request import LoRARequest
from pagekube.engine.outputs import RequestOutput
from pagekube.engine.sampling_params import SamplingParams
from pagekube.engine.text_outputs import RequestText

if TYPE_CHECKING:
    from pagekube.engine.llm_engine import LLMEngine

log = logging.getLogger("pagekube.engine")
T = TypeVar("T")


class RequestStream:
    """One request's outputs; iterate it (a RequestOutput per step, the last with finished=True).
    Leaving the iteration early (client gone, task cancelled) aborts the request and frees its blocks."""

    def __init__(self, engine: AsyncEngine, request, out_q: asyncio.Queue):
        self.engine = engine
        self.request = request
        self.request_id = request.request_id
        self._q = out_q

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await self._q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.engine.abort(self.request_id)

    async def final(self) -> RequestOutput:
        last = None
        async for out in self:
            last = out
        return last


class EngineThread:
    """The one (daemon) thread on which the server's torch work runs: it loads the model, then steps it. Torch's
    OpenMP team belongs to the thread that first ran parallel work; stepping on another thread than the one that
    loaded the model made every step 2.3x slower on 2 cores (a second team whose workers are not kept warm).
    Not a ThreadPoolExecutor: its threads are joined at interpreter exit, and a loop stuck in a dead rank's
    collective would then keep the server from exiting."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._work, name="engine-loop", daemon=True).start()

    def submit(self, fn: Callable[..., T], *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - the submitter gets it
                    future.set_exception(e)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, engine_thread: EngineThread | None = None):
        """`engine_thread`: the thread that loaded `engine` (see EngineThread); a new one if not given."""
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, RequestText]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.dead: BaseException | None = None
        self._waiting_snapshot = 0  # the scheduler's waiting requests, as the loop thread last counted them
        self._admitted = 0  # admitted, not yet in the scheduler: tokenizing, or on their way to the loop thread
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._detokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="detokenizer")  # FIFO: in order
        engine.outputs.inline_text = False  # the engine reports token deltas; text is made on the detokenizer
        self._loop_done = (engine_thread or EngineThread()).submit(self._run)

    # ---- API for request handlers (any thread, with a running event loop) ----------------------------------
    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._streams)

    def num_waiting(self) -> int:
        """Requests waiting, for admission control and `vllm:num_requests_waiting`: every request from the moment
        it is admitted (tokenizing included) until it runs or ends. The scheduler's part is a snapshot the loop
        thread takes (its queue must not be iterated from here while it changes)."""
        with self._lock:
            return self._waiting_snapshot + self._admitted

    def reserve(self) -> None:
        """Count one admitted request as waiting until `release`: an API handler holds this from its admission
        check until its engine requests are added, so a burst cannot all pass the check before any is counted."""
        with self._lock:
            self._admitted += 1

    def release(self) -> None:
        with self._lock:
            self._admitted -= 1

    async def run_tokenizer(self, fn: Callable[..., T], *args) -> T:
        """Run a tokenizer call (encode, chat template, decode) on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, functools.partial(fn, *args))

    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                          reserved: bool = False, lora_request: LoRARequest | None = None) -> RequestStream:
        """Tokenize, validate and queue a request. Raises RequestRejected (bad request) before anything is queued.
        `reserved`: the caller's admission slot (`reserve`) becomes this request's, so it is never counted twice."""
        request_id = request_id or uuid.uuid4().hex
        if not reserved:
            self.reserve()  # released by the loop thread once the request is in the scheduler (or dropped)
        try:
            self._check_alive()
            req = await self.run_tokenizer(self.engine.prepare_request, request_id, prompt, params, lora_request)
            out_q: asyncio.Queue = asyncio.Queue()
            text = RequestText(self.engine.tokenizer, req.prompt_token_ids, params)
            with self._lock:
                self._streams[request_id] = (asyncio.get_running_loop(), out_q, text)
            if self.dead:  # it died while we tokenized; a stream registered after its last words would hang
                with self._lock:
                    self._streams.pop(request_id, None)
                self._check_alive()
        except BaseException:
            self.release()
            raise
        self._commands.put(("add", req))
        return RequestStream(self, req, out_q)

    def _check_alive(self) -> None:
        if self.dead:
            raise EngineDeadError(f"the engine loop has stopped: {self.dead}")

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        self._commands.put(("abort_all", None))

    def shutdown(self, timeout: float = 10) -> None:
        """Stop the loop; the loop thread itself then stops the tensor-parallel workers (it is the thread in
        collectives with them). A loop that does not stop in time is stuck: its workers are killed instead."""
        self._stop.set()
        self._commands.put(("wake", None))
        try:
            self._loop_done.result(timeout=timeout)
        except FutureTimeout:
            log.warning("the engine loop did not stop within %.0f s; killing its workers", timeout)
            if self.engine.workers is not None:
                self.engine.workers.kill()
        except BaseException:  # noqa: BLE001 - the loop's own error was logged and reported when it died
            pass
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._detokenizer.shutdown(wait=False, cancel_futures=True)

    # ---- the loop thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        if self.engine.workers is not None:  # a worker's death is known at once, even mid-collective
            self.engine.workers.on_failure = lambda reason: self._die(WorkerDied(reason))
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                for out in self.engine.step():
                    self._deliver(out)
                self._waiting_snapshot = self.engine.num_waiting
        except BaseException as e:  # noqa: BLE001 - every stream must hear about it, or it hangs
            log.exception("engine loop died")
            died = self.engine.workers.poll() if self.engine.workers is not None else None
            self._die(WorkerDied(died) if died else e)  # a collective's error: say which worker died
        finally:
            self.engine.close()

    def _die(self, e: BaseException) -> None:
        """Fail every open stream with an error event (any thread; the first cause wins)."""
        with self._lock:
            if self.dead is not None:
                return
            self.dead = e
            streams = list(self._streams.values())
            self._streams.clear()
        for loop, q, _ in streams:
            loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(f"engine loop died: {e}"))

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = cmd
            if kind == "add":
                with self._lock:
                    live = arg.request_id in self._streams
                if live:  # it may have been aborted before we got here
                    self.engine.enqueue(arg)
                with self._lock:  # from admitted to the scheduler's count in one move: never counted twice
                    self._waiting_snapshot += live  # (the snapshot is recounted after each step)
                    self._admitted -= 1
            elif kind == "abort":
                self._abort(arg)
            elif kind == "abort_all":
                for rid in list(self.engine.requests):
                    self._abort(rid)
            elif kind == "stop":  # a stop string the detokenizer found
                out = self.engine.finish_by_stop(arg.request_id, arg.index, arg.stop, arg.num_output_tokens)
                if out is not None:
                    self._deliver(out)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._deliver(out)
        else:  # never enqueued, or already done: forget it after what is on its way to the client
            self._detokenizer.submit(self._forget, request_id)

    def _deliver(self, out: RequestOutput) -> None:
        """Hand an engine output to the detokenizer thread (in order); the engine thread goes on stepping."""
        self._detokenizer.submit(self._emit, out)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def _emit(self, out: RequestOutput) -> None:
        """On the detokenizer thread: the engine's token delta becomes the client's output (text, stop strings,
        output kind); a stop string found here is sent to the engine thread to finish the sequence."""
        with self._lock:
            target = self._streams.get(out.request_id)
        if target is None:
            return  # finished here already (a stop string), or the client is gone
        loop, q, text = target
        try:
            shown, stops = text.apply(out)
        except Exception as e:  # noqa: BLE001 - the client hears of it; the engine drops the request
            log.exception("request %s: making its text failed", out.request_id)
            self._forget(out.request_id)
            self._commands.put(("abort", out.request_id))
            loop.call_soon_threadsafe(q.put_nowait, e)
            return
        for stop in stops:
            self._commands.put(("stop", stop))
        if shown is None:
            return
        if shown.finished:
            self._forget(out.request_id)
        loop.call_soon_threadsafe(q.put_nowait, shown)
