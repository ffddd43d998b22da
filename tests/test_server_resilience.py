"""The server under stress it must survive: a huge prompt being tokenized, an engine loop that dies, and the
per-request log line. Real `pagekube serve` processes (tiny model) or the app in-process with a fault injected."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pagekube.engine.async_engine import AsyncEngine
from pagekube.engine.config import EngineConfig
from pagekube.engine.llm_engine import LLMEngine
from pagekube.engine.server.app import ServerState, create_app
from tests.server_process import ServerProcess


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
    lines = [json.loads(x) for x in logged_server.log_path.read_text().splitlines() if x.startswith("{")]
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
