"""What the operator renders, run for real on loopback: two engine replicas behind the operator's own NGINX config,
a real Prometheus scraping them with the labels the operator's pods carry, and the ScaledObject's exact query.

Only the upstream addresses (loopback ports instead of the headless Service) and the listen port differ from what
a cluster gets; `render_nginx_conf` is called exactly as the ConfigMap builder calls it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from e2e.loopback import Nginx, Prometheus, engine_replicas
from e2e.waiting import wait_for
from pagekube.operator.autoscaling import build_scaled_object
from pagekube.operator.spec import LLMDeploymentSpec
from tests.k8s_tools import REPO
from tests.server_process import ServerProcess, json_log_lines, metric

pytestmark = pytest.mark.skipif(not (shutil.which("nginx") and shutil.which("prometheus")),
                                reason="nginx and prometheus (Debian packages) are installed by scripts/test-deps.sh")

NAME, NAMESPACE = "demo", "default"
SPEC = LLMDeploymentSpec.model_validate({
    "model": {"name": "SmolLM2-135M-Instruct", "source": "file:///models/smollm2"},
    "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 8, "queueDepthTarget": 2, "activationQueueDepth": 0},
})
# Pod names as the engine Deployment's ReplicaSet would make them: the ScaledObject's query matches on them.
POD_NAMES = ["demo-engine-7f9c6d5b8-a1b2c", "demo-engine-7f9c6d5b8-x9y8z"]
ENGINE_ARGS = ["--max-num-seqs", "4", "--kv-cache-memory", str(64 * 1024**2), "--dtype", "float32", "--drain-timeout", "120"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    d = tmp_path_factory.mktemp("engines")
    # Two engines share this machine's 2 cores: one OpenMP thread each, as on a node where each pod has its cores
    # (two 2-thread teams spinning on 2 cores starve each other: the drain then outlasts its timeout).
    one_core = {**os.environ, "OMP_NUM_THREADS": "1"}
    with engine_replicas(2, [*ENGINE_ARGS, "--served-model-name", SPEC.model.name], d, one_core) as procs:
        yield procs


@pytest.fixture(scope="module")
def nginx(engines, tmp_path_factory):
    lb = Nginx(tmp_path_factory.mktemp("nginx"), SPEC, [f"127.0.0.1:{e.port}" for e in engines])
    yield lb
    lb.stop()


@pytest.fixture(scope="module")
def prometheus(engines, tmp_path_factory):
    # The labels a ServiceMonitor or the scrape annotations give the operator's engine pods.
    prom = Prometheus(tmp_path_factory.mktemp("prometheus"),
                      [(f"127.0.0.1:{e.port}", {"namespace": NAMESPACE, "pod": pod}, "/metrics")
                       for e, pod in zip(engines, POD_NAMES)])
    yield prom.url
    prom.stop()


def client(nginx) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{nginx.port}/v1", api_key="none", max_retries=0, timeout=300)


def served(engine) -> float:
    return metric(httpx.get(engine.url + "/metrics").text, "vllm:request_success_total")


def test_streams_token_by_token_through_nginx_and_spreads_over_both_replicas(engines, nginx):
    c = client(nginx)
    start = time.monotonic()
    arrivals = []
    stream = c.completions.create(model=SPEC.model.name, prompt="Once upon a time", max_tokens=48, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
    text = ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.monotonic() - start)
            text += chunk.choices[0].text
    # Unbuffered: the first token arrives long before the last; bunching would put them all at the end.
    print(f"\n[e2e] {len(arrivals)} chunks through nginx: first at {arrivals[0]:.2f} s, middle at "
          f"{arrivals[len(arrivals) // 2]:.2f} s, last at {arrivals[-1]:.2f} s")
    assert len(arrivals) >= 24
    assert arrivals[0] < 0.5 * arrivals[-1], arrivals
    assert arrivals[len(arrivals) // 2] < 0.8 * arrivals[-1], arrivals
    whole = c.completions.create(model=SPEC.model.name, prompt="Once upon a time", max_tokens=48, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert whole.choices[0].text == text and whole.choices[0].finish_reason == "length"

    before = [served(e) for e in engines]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: c.chat.completions.create(model=SPEC.model.name, max_tokens=8,
                                                          messages=[{"role": "user", "content": f"Count to {i}"}]), range(16)))
    grown = [served(e) - b for e, b in zip(engines, before)]
    print(f"[e2e] 16 chat requests through nginx: {grown[0]:.0f} + {grown[1]:.0f} per replica")
    assert sum(grown) == 16 and min(grown) >= 4, grown  # least_conn: both replicas took a real share


def query(prometheus, promql) -> float:
    r = httpx.get(prometheus + "/api/v1/query", params={"query": promql}).json()
    assert r["status"] == "success", r
    return float(r["data"]["result"][0]["value"][1])


def test_scaled_object_query_through_prometheus_gives_the_replicas_keda_would_ask_for(engines, nginx, prometheus):
    trigger = build_scaled_object(NAME, NAMESPACE, SPEC)["spec"]["triggers"][0]["metadata"]
    promql, threshold, activation = trigger["query"], float(trigger["threshold"]), float(trigger["activationThreshold"])

    def wait_for_value(ok, timeout):
        return wait_for(lambda: query(prometheus, promql), ok, timeout, what="the ScaledObject query")

    wait_for_value(lambda v: v == 0, 30)
    c = client(nginx)
    done = threading.Event()

    def load():
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda i: c.completions.create(model=SPEC.model.name, prompt=f"Story {i}:", max_tokens=48,
                                                         extra_body={"ignore_eos": True}), range(32)))
        done.set()

    threading.Thread(target=load, daemon=True).start()
    # 2 replicas x 4 running, the rest wait: more than 2 x threshold waiting means KEDA wants more than 2 replicas.
    peak = wait_for_value(lambda v: v > threshold * 2, 60)
    desired = min(math.ceil(peak / threshold), SPEC.autoscaling.max_replicas)  # HPA on an AverageValue metric
    print(f"[e2e] ScaledObject query peaked at {peak:.0f} waiting (threshold {threshold:.0f}) -> KEDA asks {desired} replicas")
    assert desired > len(engines), (peak, desired)
    assert done.wait(300)
    idle = wait_for_value(lambda v: v <= activation, 30)  # idle: below activation, KEDA scales to minReplicas 0
    assert idle == 0 and SPEC.autoscaling.min_replicas == 0


def test_every_grafana_panel_query_returns_data_from_the_scraped_engines(engines, nginx, prometheus):
    """The shipped dashboard's PromQL, with Grafana's variables filled in as Grafana would, against real series."""
    dashboard = json.loads((REPO / "charts/pagekube/files/grafana-dashboard.json").read_text())
    c = client(nginx)
    with ThreadPoolExecutor(4) as pool:  # fresh observations for the rate() windows; a shared prefix for the cache
        list(pool.map(lambda i: c.completions.create(model=SPEC.model.name, max_tokens=8,
                                                     prompt="A shared system prompt that is long enough to fill one "
                                                            f"whole block of the cache, and then: question {i}"), range(8)))
    time.sleep(3)  # a few 1 s scrapes
    engine_panels = [p for p in dashboard["panels"] if not p["title"].startswith("Operator:")]  # those: scale test
    for panel in engine_panels:
        for target in panel["targets"]:
            promql = target["expr"].replace("$__rate_interval", "1m").replace("$model_name", ".+")
            r = httpx.get(prometheus + "/api/v1/query", params={"query": promql}).json()
            assert r["status"] == "success", (panel["title"], promql, r)
            assert r["data"]["result"], f"{panel['title']}: no data for {promql}"
    print(f"[e2e] {sum(len(p['targets']) for p in engine_panels)} dashboard queries over "
          f"{len(engine_panels)} engine panels all returned data")


def test_rolling_drain_loses_no_request(engines, nginx):
    """32 streams in flight; replica 1 leaves as in a rollout: endpoints drop it, preStop sleeps, SIGTERM drains it."""
    c = client(nginx)
    results: list = [None] * 32

    def stream(i):
        text, finish = "", None
        for chunk in c.completions.create(model=SPEC.model.name, prompt=f"Tale {i}:", max_tokens=48, stream=True,
                                          extra_body={"ignore_eos": True}):
            if chunk.choices:
                text += chunk.choices[0].text or ""
                finish = chunk.choices[0].finish_reason or finish
        results[i] = (finish, text)

    leaving = engines[1]
    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(stream, i) for i in range(32)]
        wait_for(lambda: metric(httpx.get(leaving.url + "/metrics").text, "vllm:num_requests_running"), lambda v: v > 0, 60,
                 what="streams running on the leaving replica")
        nginx.reload([f"127.0.0.1:{engines[0].port}"])  # endpoint removal
        time.sleep(SPEC.drain.pre_stop_delay_seconds)  # the preStop sleep
        in_flight = sum(metric(httpx.get(leaving.url + "/metrics").text, m)
                        for m in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        assert in_flight > 0, "the leaving replica finished before SIGTERM: nothing would test the drain"
        leaving.signal(signal.SIGTERM)
        during = [c.completions.create(model=SPEC.model.name, prompt="New user", max_tokens=4) for _ in range(4)]
        for f in futures:
            f.result()  # raises if any request failed
    print(f"[e2e] drain: SIGTERM with {in_flight:.0f} requests on the leaving replica; "
          f"{sum(r[0] == 'length' for r in results if r)}/32 streams finished 'length', "
          f"{len(during)} new requests during the drain all answered")
    assert all(r.choices[0].finish_reason == "length" for r in during)
    assert [r[0] for r in results] == ["length"] * 32
    assert all(len(r[1]) > 0 for r in results)
    assert leaving.proc.wait(120) == 0  # drained and exited cleanly


def test_a_draining_replica_still_in_the_pod_list_loses_no_new_request(engines, tmp_path):
    """A deleted pod drains while NGINX still lists it (its DNS answer outlives the endpoint removal when the
    preStop sleep is shorter than the resolver's cache): the refusals (503, not started) reach the other engine."""
    leaving = ServerProcess(*ENGINE_ARGS, "--served-model-name", SPEC.model.name, log_path=tmp_path / "leaving.log",
                            env={**os.environ, "OMP_NUM_THREADS": "1"}).wait_ready()
    (tmp_path / "nginx").mkdir()
    lb = Nginx(tmp_path / "nginx", SPEC, [f"127.0.0.1:{engines[0].port}", f"127.0.0.1:{leaving.port}"])
    direct = openai.OpenAI(base_url=leaving.url + "/v1", api_key="none", max_retries=0, timeout=300)
    try:
        with ThreadPoolExecutor(1) as pool:
            # A long stream straight to the leaving engine keeps its drain going while new requests arrive.
            held = pool.submit(lambda: list(direct.completions.create(
                model=SPEC.model.name, prompt="Tale:", max_tokens=1000, stream=True, extra_body={"ignore_eos": True})))
            wait_for(lambda: metric(httpx.get(leaving.url + "/metrics").text, "vllm:num_requests_running"),
                     lambda v: v > 0, 60, what="the held stream running")
            leaving.signal(signal.SIGTERM)
            wait_for(lambda: httpx.get(leaving.url + "/health").status_code, lambda s: s == 503, 10,
                     what="the leaving engine draining")
            answers = [client(lb).completions.create(model=SPEC.model.name, prompt=f"New user {i}", max_tokens=4)
                       for i in range(8)]
            assert held.result() and leaving.proc.wait(60) == 0  # the held stream finished, then the drain ended
    finally:
        lb.stop()
        leaving.stop()
    refused = [e for e in json_log_lines(lb.dir / "nginx.out") if "503" in e["upstream_status"]]
    print(f"\n[e2e] 8 new requests while a listed engine drained: {len(refused)} refused by it and passed on "
          f"({sorted({e['upstream_status'] for e in refused})}), all answered")
    assert all(a.choices[0].finish_reason == "length" for a in answers)
    assert refused and all(e["status"] == 200 for e in refused), refused  # the refusals happened, and were recovered
