"""Graceful drain with the real process: SIGTERM -> /health 503 at once, new work refused, accepted work finishes
(or ends with finish_reason "abort" at the drain timeout), exit 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"


def stream_completion(url: str, max_tokens: int, results: list, started: threading.Event | None = None) -> None:
    body = {"model": MODEL, "prompt": "Tell me a long story about a dragon.", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}
    finish, done, n = None, False, 0
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                r.read()
                results.append((None, False, f"HTTP {r.status_code} retry-after={r.headers.get('retry-after')}"))
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                n += 1
                if started and n == 1:
                    started.set()
                for c in chunk.get("choices", []):
                    finish = c.get("finish_reason") or finish
        results.append((finish, done, None))
    except Exception as e:  # noqa: BLE001 - recorded, asserted on below
        results.append((finish, done, repr(e)))


def gauge(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def waiting(url: str) -> float:
    return gauge(url, "vllm:num_requests_waiting")


def start_streams(url: str, count: int, max_tokens: int) -> tuple[list, list[threading.Thread]]:
    results: list = []
    events = [threading.Event() for _ in range(count)]
    threads = [threading.Thread(target=stream_completion, args=(url, max_tokens, results, ev)) for ev in events]
    for t in threads:
        t.start()
    for ev in events:
        assert ev.wait(120), "a stream never started"
    return results, threads


@pytest.fixture
def make_server(bundled_dir):
    servers = []

    def make(*args):
        srv = ServerProcess(str(bundled_dir), "--served-model-name", MODEL, "--kv-cache-memory", str(128 * 1024**2), *args)
        servers.append(srv)
        return srv.wait_ready()

    yield make
    for srv in servers:
        srv.stop()


def test_sigterm_drains_every_accepted_stream_then_exits_0(make_server):
    srv = make_server("--drain-timeout", "120")
    results, threads = start_streams(srv.url, 16, 48)
    srv.signal(signal.SIGTERM)
    t0 = time.monotonic()
    while httpx.get(srv.url + "/health", timeout=1).status_code != 503:
        pass
    assert time.monotonic() - t0 < 0.1
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "draining"
    for t in threads:
        t.join(120)
    assert len(results) == 16
    assert all(err is None and done and finish == "length" for finish, done, err in results), results
    assert srv.proc.wait(30) == 0


def test_drain_timeout_aborts_what_is_left_with_a_final_chunk(make_server):
    srv = make_server("--drain-timeout", "1")
    results, threads = start_streams(srv.url, 4, 400)
    srv.signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert len(results) == 4
    assert all(err is None and done and finish == "abort" for finish, done, err in results), results
    assert srv.proc.wait(30) == 0


def test_second_signal_exits_at_once(make_server):
    srv = make_server("--drain-timeout", "120")
    results, threads = start_streams(srv.url, 2, 400)
    srv.signal(signal.SIGTERM)
    time.sleep(0.3)
    srv.signal(signal.SIGINT)
    assert srv.proc.wait(10) == 1  # at once, and non-zero: it did not drain
    for t in threads:
        t.join(30)
    assert len(results) == 2  # clients see the connection close; none hangs


def test_full_queue_answers_429_with_retry_after_and_keeps_serving(make_server):
    srv = make_server("--max-num-seqs", "1", "--max-waiting-requests", "2")
    results, threads = start_streams(srv.url, 1, 400)  # it runs (max-num-seqs 1; 400 tokens take seconds)
    deadline = time.monotonic() + 30  # running before the others arrive, or it would still count as waiting
    while time.monotonic() < deadline and gauge(srv.url, "vllm:num_requests_running") < 1:
        time.sleep(0.02)
    for _ in range(3):  # two wait, the third finds the queue full
        t = threading.Thread(target=stream_completion, args=(srv.url, 400, results))
        t.start()
        threads.append(t)
    deadline = time.monotonic() + 30  # until two wait and the third has had its answer (a fixed sleep raced)
    while time.monotonic() < deadline and not (waiting(srv.url) == 2 and len(results) >= 1):
        time.sleep(0.05)
    rejected = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                          timeout=120)
    assert rejected.status_code == 429, (rejected.text, waiting(srv.url), results, time.monotonic() - deadline)
    assert rejected.headers["retry-after"] and rejected.json()["error"]["code"] == "queue_full"
    for t in threads:
        t.join(120)
    served = [r for r in results if r[2] is None]
    assert len(served) >= 2 and all(f == "length" and done for f, done, _ in served)  # accepted ones all finish
    assert all(err == "HTTP 429 retry-after=1" for _, _, err in results if err is not None), results
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200
