"""The server under stress it must survive: a huge prompt being tokenized, an engine loop that dies, and the
per-request log line. Real `pagekube serve` processes (tiny model) or the app in-process with a fault injected."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import types

import httpx
import pytest

from pagekube.engine.async_engine import AsyncEngine
from pagekube.engine.config import EngineConfig
from pagekube.engine.llm_engine import LLMEngine
from pagekube.engine.server.app import ServerState, create_app
from tests.server_process import ServerProcess, json_log_lines


@pytest.fixture(scope="module")
def logged_server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    srv = ServerProcess(str(tiny_dir), "--served-model-name", "tiny", log_path=log)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_a_huge_prompt_being_tokenized_does_not_stall_other_streams(logged_server):
    url = logged_server.url + "/v1/completions"
    arrivals: list[float] = []
    started = threading.Event()

    def stream():
        body = {"model": "tiny", "prompt": "go", "max_tokens": 1500, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 5:
                        started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    huge = " ".join(f"word{i % 977} token{i % 113}" for i in range(100_000))  # ~2.1M characters
    t0 = time.monotonic()
    r = httpx.post(url, json={"model": "tiny", "prompt": huge, "max_tokens": 1}, timeout=120)
    t1 = time.monotonic()
    reader.join(120)
    assert r.status_code == 400 and "max model length" in r.json()["error"]["message"]  # it was tokenized
    # The event loop kept writing the other stream's chunks all through the tokenization, not in one burst after
    # it: no silence covers more than half of the window (a blocked loop leaves one gap as long as the window).
    points = [t0, *(t for t in arrivals if t0 <= t <= t1), t1]
    gap = max(b - a for a, b in zip(points, points[1:]))
    assert len(points) > 12 and gap < 0.5 * (t1 - t0), f"{len(points) - 2} chunks, longest gap {gap:.2f} s of {t1 - t0:.2f}"


def test_every_request_gets_one_log_line_without_prompt_text(logged_server):
    secret = "my-secret-prompt-text"
    httpx.post(logged_server.url + "/v1/completions", json={"prompt": secret, "max_tokens": 3}, timeout=60)
    with httpx.stream("POST", logged_server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": secret}], "max_tokens": 4, "stream": True}) as r:
        list(r.iter_lines())
    time.sleep(0.5)
    lines = json_log_lines(logged_server.log_path)
    finished = [x for x in lines if x.get("event") == "request_finished"]
    assert secret not in logged_server.log_path.read_text()
    plain = [x for x in finished if x["id"].startswith("cmpl-")][-1]
    streamed = [x for x in finished if x["id"].startswith("chatcmpl-")][-1]
    assert plain["output_tokens"] == 3 and plain["finish_reason"] in ("length", "stop")
    assert streamed["output_tokens"] <= 4 and streamed["model"] == "tiny"
    for rec in (plain, streamed):
        assert rec["prompt_tokens"] > 0 and rec["ttft_s"] >= rec["queue_s"] >= 0 and rec["e2e_s"] >= rec["ttft_s"]
        assert "prompt" not in rec


def test_health_answers_loading_before_torch_is_imported():
    code = ("import sys, pagekube.engine.server.serve, pagekube.engine.cli; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"  # the socket listens (and /health says 503 loading) before the heavy imports


def test_health_is_503_loading_while_the_model_loads(tiny_dir):
    srv = ServerProcess(str(tiny_dir))
    try:
        first = None
        deadline = time.monotonic() + 60
        while first is None and time.monotonic() < deadline:
            try:
                first = httpx.get(srv.url + "/health", timeout=1)
            except httpx.TransportError:
                time.sleep(0.05)
        assert first is not None and first.status_code == 503
        assert first.json()["error"]["code"] == "loading"
        srv.wait_ready()
        messages = [e["msg"] for e in json_log_lines(srv.log_path)]
        listening = next(i for i, m in enumerate(messages) if m.startswith("Uvicorn running on"))
        assert listening < messages.index("loading the model")  # the socket listens before torch is imported
    finally:
        srv.stop()


# ---- a failure injected into the engine loop (in-process app; the step is made to raise) ----------------------
@pytest.fixture
def dying_app(tiny_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_dir)))
    real_step, calls = engine.step, {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] > 5:
            raise RuntimeError("injected failure")
        return real_step()

    engine.step = step
    state = ServerState(EngineConfig(model=str(tiny_dir)))
    state.engine = AsyncEngine(engine)
    try:
        yield create_app(state), state
    finally:
        state.engine.shutdown()


def test_a_dead_engine_loop_ends_every_open_stream_with_an_error_event(dying_app):
    app, state = dying_app

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=30) as client:
            long = {"max_tokens": 500, "ignore_eos": True}
            streams = [client.post("/v1/completions", json={"prompt": ["a", "b"], "stream": True, **long}),
                       client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "stream": True, **long}),
                       client.post("/v1/completions", json={"prompt": "c", **long})]
            return await asyncio.wait_for(asyncio.gather(*streams), 60)  # never a hang

    merged, chat, plain = asyncio.run(scenario())
    for r in (merged, chat):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert set(err) == {"message", "type", "param", "code"} and "injected failure" in err["message"]
    assert plain.status_code == 503 and "injected failure" in plain.json()["error"]["message"]
    assert state.engine.dead is not None and not state.healthy


def test_the_thread_that_loads_the_model_is_the_one_that_steps_it(tiny_dir):
    """Torch's OpenMP team is per thread: the server loads and steps on one EngineThread (2.3x faster steps)."""
    from pagekube.engine import SamplingParams
    from pagekube.engine.async_engine import EngineThread

    engine_thread = EngineThread()
    loaded_on = engine_thread.submit(threading.get_ident).result(timeout=10)
    engine = engine_thread.submit(LLMEngine, EngineConfig(model=str(tiny_dir))).result(timeout=60)
    stepped_on, real_step = set(), engine.step

    def step():
        stepped_on.add(threading.get_ident())
        return real_step()

    engine.step = step
    async_engine = AsyncEngine(engine, engine_thread)

    async def one_request():
        stream = await async_engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        return await stream.final()

    try:
        assert len(asyncio.run(one_request()).outputs[0].token_ids) == 4
    finally:
        async_engine.shutdown()
    assert stepped_on == {loaded_on}


# ---- shutdown with a loop stuck in a step (as in a collective with a dead tensor-parallel peer) ----------------
class StuckEngine:
    """Stands in for an LLMEngine whose step never returns until released; records who closes it."""

    def __init__(self):
        self.release = threading.Event()
        self.closed_on: str | None = None
        self.workers = self
        self.killed = False
        self.on_failure = None
        self.num_waiting = 0
        self.outputs = types.SimpleNamespace(inline_text=True)

    def has_unfinished_requests(self) -> bool:
        return True

    def step(self):
        self.release.wait(30)
        return []

    def kill(self) -> None:
        self.killed = True

    def close(self) -> None:
        self.closed_on = threading.current_thread().name


def test_shutdown_of_a_stuck_loop_kills_the_workers_and_only_the_loop_thread_closes_the_engine():
    stuck = StuckEngine()
    engine = AsyncEngine(stuck)
    time.sleep(0.2)  # the loop is in its step
    started = time.monotonic()
    engine.shutdown(timeout=0.5)
    assert time.monotonic() - started < 5 and stuck.killed  # returned, and the stuck peers were ended
    assert stuck.closed_on is None  # STOP is never broadcast from this thread
    stuck.release.set()
    deadline = time.monotonic() + 5
    while stuck.closed_on is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stuck.closed_on == "engine-loop"


def test_a_dead_worker_reported_by_the_watchdog_fails_open_streams_at_once():
    stuck = StuckEngine()
    engine = AsyncEngine(stuck)
    time.sleep(0.2)

    async def open_stream_then_die():
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with engine._lock:
            engine._streams["r"] = (loop, q, None)
        threading.Thread(target=stuck.on_failure, args=("tensor-parallel worker rank 1 died (exit code -9)",),
                         name="tp-watchdog").start()
        return await asyncio.wait_for(q.get(), 5)

    err = asyncio.run(open_stream_then_die())
    assert "rank 1 died" in str(err) and engine.dead is not None  # while the loop is still stuck in its step
    stuck.release.set()
    engine.shutdown(timeout=5)


def test_logprob_token_strings_are_decoded_on_the_tokenizer_thread(tiny_dir, monkeypatch):
    from pagekube.engine.server import rendering

    threads = []
    real = rendering.token_strings
    monkeypatch.setattr(rendering, "token_strings",
                        lambda tok, ids: threads.append(threading.current_thread().name) or real(tok, ids))
    state = ServerState(EngineConfig(model=str(tiny_dir)))
    state.engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_dir))))

    async def ask():
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            chat = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
                "top_logprobs": 2})
            plain = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 2,
                                                               "stream": True})
            return chat, plain
    try:
        chat, plain = asyncio.run(ask())
    finally:
        state.engine.shutdown()
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 and c["token"] for c in content)
    assert plain.status_code == 200 and '"top_logprobs"' in plain.text
    assert threads and all(name.startswith("tokenizer") for name in threads), threads


def test_a_request_being_queued_counts_once_toward_the_waiting_limit(tiny_dir):
    """The API handler's admission slot (enter_queue) becomes its engine request's (add_request(reserved=True)):
    while its prompt tokenizes it counts once. It used to count twice, so a burst near --max-waiting-requests got a
    429 early (tests/test_drain.py's full-queue test flaked on it)."""
    from pagekube.engine import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_dir)))
    tokenizing, release = threading.Event(), threading.Event()
    prepare = engine.prepare_request

    def slow_prepare(*args):
        tokenizing.set()
        release.wait(10)
        return prepare(*args)

    engine.prepare_request = slow_prepare
    eng = AsyncEngine(engine)

    async def scenario() -> tuple[int, list]:
        eng.reserve()  # what the handler's admission does
        task = asyncio.ensure_future(eng.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True),
                                                     reserved=True))
        while not tokenizing.is_set():
            await asyncio.sleep(0.01)
        counted = eng.num_waiting()
        release.set()
        outputs = [out async for out in await task]
        return counted, outputs

    try:
        counted, outputs = asyncio.run(scenario())
        assert counted == 1 and outputs[-1].finished
        assert eng.num_waiting() == 0  # and nothing is left counted once it ran
    finally:
        eng.shutdown()
