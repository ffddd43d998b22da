"""Scale from zero on loopback, real parts: NGINX with the operator's config (the activator as its backup), the
activator process, a real Prometheus scraping it, and a stand-in for KEDA that evaluates the ScaledObject's exact
query through Prometheus' HTTP API and starts an engine once it crosses activationThreshold (KEDA itself needs a
cluster; the harness here has no kubelet). Requests sent while nothing serves must all complete."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from e2e.cluster import stop_process_group
from e2e.loopback import Nginx, Prometheus, wait_http
from pagekube.operator.autoscaling import build_scaled_object
from pagekube.operator.spec import LLMDeploymentSpec
from tests.server_process import ServerProcess, free_port

pytestmark = pytest.mark.skipif(not (shutil.which("nginx") and shutil.which("prometheus")),
                                reason="nginx and prometheus (Debian packages) are installed by scripts/test-deps.sh")

NAME, NAMESPACE, MODEL = "cold", "default", "SmolLM2-135M-Instruct"


def spec_with(max_pending: int, hold_timeout: int, strategy: str = "LeastConnections") -> LLMDeploymentSpec:
    return LLMDeploymentSpec.model_validate({
        "model": {"name": MODEL, "source": "file:///models/smollm2"},
        "loadBalancer": {"strategy": strategy},
        "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2, "activationQueueDepth": 0,
                        "activator": {"maxPending": max_pending, "holdTimeoutSeconds": hold_timeout}},
    })


class KedaStandIn(threading.Thread):
    """Polls the ScaledObject's query like KEDA's prometheus scaler; past activationThreshold, scales 0 -> 1 by
    starting the engine (what the HPA + kubelet would do)."""

    def __init__(self, prometheus: Prometheus, spec: LLMDeploymentSpec, start_engine):
        super().__init__(daemon=True)
        trigger = build_scaled_object(NAME, NAMESPACE, spec)["spec"]["triggers"][0]["metadata"]
        self.query, self.activation = trigger["query"], float(trigger["activationThreshold"])
        self.prometheus, self.start_engine = prometheus, start_engine
        self.activated_at: float | None = None
        self.peak = 0.0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.wait(0.5):
            value = self.prometheus.query(self.query) or 0.0
            self.peak = max(self.peak, value)
            if value > self.activation and self.activated_at is None:
                self.activated_at = time.monotonic()
                self.start_engine()


@pytest.fixture
def cold_stack(tmp_path):
    """Everything at zero replicas; returns a factory taking (max_pending, hold_timeout, wake)."""
    started: list = []

    def make(max_pending: int, hold_timeout: int, wake: bool, strategy: str = "LeastConnections"):
        spec = spec_with(max_pending, hold_timeout, strategy)
        engine_port, activator_port = free_port(), free_port()
        activator = subprocess.Popen(
            [sys.executable, "-m", "pagekube.operator.cli", "activator", "--llmdeployment", NAME, "--host", "127.0.0.1",
             "--port", str(activator_port), "--upstream", f"127.0.0.1:{engine_port}",
             "--max-pending", str(max_pending), "--hold-timeout", str(hold_timeout)],
            stdout=open(tmp_path / "activator.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
        started.append(activator)
        wait_http(f"http://127.0.0.1:{activator_port}/activator/healthz")
        prom = Prometheus(tmp_path, [(f"127.0.0.1:{activator_port}", {"namespace": NAMESPACE}, "/activator/metrics")])
        started.append(prom)
        lb = Nginx(tmp_path, spec, [f"127.0.0.1:{engine_port}"], backups=[f"127.0.0.1:{activator_port}"])
        started.append(lb)

        def start_engine():
            engine = ServerProcess("--served-model-name", MODEL, "--dtype", "float32",
                                   "--kv-cache-memory", str(64 * 1024**2), port=engine_port,
                                   log_path=tmp_path / "engine.log")
            started.append(engine)

        keda = KedaStandIn(prom, spec, start_engine)
        if wake:
            keda.start()
        started.append(keda)
        return lb, keda

    yield make
    for part in reversed(started):
        if isinstance(part, KedaStandIn):
            part.stop.set()
            if part.is_alive():
                part.join()  # before Prometheus stops under its query
        elif isinstance(part, subprocess.Popen):
            stop_process_group(part)
        else:
            part.stop()


@pytest.mark.parametrize("strategy", ["LeastConnections", "PrefixHash"])
def test_streams_sent_at_zero_replicas_all_complete(cold_stack, strategy):
    """With PrefixHash the ring's only engine refuses connections (nothing sent): least connections, and so the
    activator, take the requests."""
    lb, keda = cold_stack(max_pending=16, hold_timeout=120, wake=True, strategy=strategy)
    client = openai.OpenAI(base_url=lb.url + "/v1", api_key="none", max_retries=0, timeout=180)

    def stream(i):
        tokens, finish = 0, None
        for chunk in client.completions.create(model=MODEL, prompt=f"Cold start {i}:", max_tokens=12, stream=True,
                                               stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}):
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return tokens, finish

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(stream, range(8)))  # any 5xx raises here
    print(f"\n[e2e] scale from zero: KEDA's query peaked at {keda.peak:.0f} held requests, activated "
          f"{keda.activated_at - t0:.1f} s after the first request; 8/8 streams done {time.monotonic() - t0:.1f} s "
          "after it")
    assert results == [(12, "length")] * 8
    assert keda.peak >= 1 and keda.activated_at is not None


def test_past_max_pending_requests_get_429_with_retry_after_and_the_rest_complete(cold_stack):
    lb, keda = cold_stack(max_pending=4, hold_timeout=120, wake=True)

    def post(i):
        return httpx.post(lb.url + "/v1/completions", timeout=180, json={
            "model": MODEL, "prompt": f"Overload {i}", "max_tokens": 4, "ignore_eos": True})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(8)))
    codes = sorted(r.status_code for r in answers)
    print(f"[e2e] {len(answers)} requests at zero with maxPending 4: {codes}")
    assert codes == [200] * 4 + [429] * 4
    for r in answers:
        if r.status_code == 429:
            assert r.headers["Retry-After"] and r.json()["error"]["code"] == "activator_full"
        else:
            assert r.json()["usage"]["completion_tokens"] == 4


def test_no_engine_ever_starts_requests_get_503_after_the_hold_timeout(cold_stack):
    lb, keda = cold_stack(max_pending=8, hold_timeout=3, wake=False)
    t0 = time.monotonic()
    r = httpx.post(lb.url + "/v1/completions", json={"model": MODEL, "prompt": "anyone?", "max_tokens": 4}, timeout=60)
    waited = time.monotonic() - t0
    assert r.status_code == 503 and r.headers["Retry-After"] and r.json()["error"]["code"] == "cold_start_timeout"
    assert waited >= 3
