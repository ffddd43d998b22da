"""Scale from zero on the real node: a `minReplicas: 0` LLMDeployment with no engine pod; requests through NGINX
fall back to the activator pod, whose pending count Prometheus scrapes through the activator's ServiceMonitor;
real KEDA activates 0 -> 1 on it, every held request completes, requests past maxPending get 429 with Retry-After,
and idleness returns the engine to zero after the cooldown."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from e2e.node.conftest import OPERATOR_IMAGE
from e2e.node.monitoring import query
from e2e.node.node import in_netns
from e2e.node.test_real_node import (
    MAX_TOKENS,
    assert_all_finished,
    component_pods,
    engine_pods,
    engine_replicas,
    llmdeployment,
    ready,
    routes,
)
from e2e.waiting import wait_for
from pagekube.operator.autoscaling import activator_pending_series

NAME = "cold"
MAX_PENDING = 4


def cold_llmdeployment() -> dict:
    manifest = llmdeployment(replicas=0, name=NAME)
    spec = manifest["spec"]
    spec.pop("adapters")
    del spec["replicas"]  # KEDA's HPA (and, from zero, KEDA itself) owns them
    spec["loadBalancer"]["replicas"] = 1
    spec["monitoring"] = {"serviceMonitor": True}  # the engines' and the activator's
    spec["autoscaling"] = {
        "enabled": True, "minReplicas": 0, "maxReplicas": 1, "activationQueueDepth": 0,
        "pollingInterval": 5, "cooldownPeriod": 30, "scaleDownStabilizationSeconds": 10,
        "activator": {"maxPending": MAX_PENDING, "holdTimeoutSeconds": 300, "image": ":".join(OPERATOR_IMAGE)}}
    return manifest


def http_status(url: str) -> int:
    r = subprocess.run(in_netns("curl", "-s", "-o", "/dev/null", "-m", "5", "-w", "%{http_code}", url),
                       capture_output=True, text=True, timeout=10)
    return int(r.stdout or 0)


def replicas(node) -> int:
    return engine_replicas(node, NAME)


@pytest.fixture(scope="module")
def cold(node, operator_release, model_claim, keda):
    node.kubectl("apply", "-f", "-", input=json.dumps(cold_llmdeployment()))
    yield wait_for(lambda: node.kubectl("get", "service", f"{NAME}-lb", "-o", "jsonpath={.spec.clusterIP}",
                                        check=False).stdout, timeout=60, what="the load balancer Service")
    node.kubectl("delete", "llmd", NAME, "--wait=true", "--timeout=300s", timeout=320)


def test_requests_at_zero_wake_the_engine_through_the_activator_and_keda_and_idleness_returns_it_to_zero(
        node, cold, stream_runs):
    url = f"http://{cold}/v1"
    try:
        wait_for(lambda: node.kubectl("get", "scaledobject", f"{NAME}-engine", "-o",
                                      "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False).stdout,
                 lambda s: s == "True", timeout=300, what="ScaledObject Ready", interval=2)
        wait_for(lambda: [ready(p) for p in component_pods(node, "activator", NAME)], lambda r: r == [True],
                 timeout=180, what="the activator pod ready", interval=2)
        wait_for(lambda: (replicas(node), engine_pods(node, NAME)), lambda r: r == (0, []), timeout=180,
                 what="no engine pod (KEDA at zero)", interval=2)
        # The activator's pending count reaches Prometheus through its ServiceMonitor (0 while nothing waits).
        wait_for(lambda: query(node, activator_pending_series(NAME, "default")), timeout=120,
                 what="the activator's pending count in Prometheus", interval=2)
        wait_for(lambda: [ready(p) for p in component_pods(node, "load-balancer", NAME)], lambda r: r == [True],
                 timeout=120, what="the NGINX pod ready", interval=2)
        # NGINX resolves its upstream names after it starts: the activator's own health path (answered, not held)
        # through NGINX says the backup is in place.
        t0 = time.monotonic()
        wait_for(lambda: http_status(f"http://{cold}/activator/healthz"), lambda code: code == 200, timeout=60,
                 what="NGINX reaching the activator", interval=1)
        print(f"\n[node] NGINX reached the activator {time.monotonic() - t0:.1f} s after its pod was ready")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{node.diagnostics()}") from None

    # No engine address: NGINX passes every request to the activator, which holds MAX_PENDING and refuses the rest.
    run = stream_runs(url, streams=MAX_PENDING + 2, max_tokens=MAX_TOKENS)
    wait_for(lambda: replicas(node), lambda r: r == 1, timeout=180, what="KEDA activating 0 -> 1", interval=2)
    results = run.results(timeout=420)
    refused = [r for r in results if r.get("status") == 429]
    lb_log = node.kubectl("logs", f"deployment/{NAME}-lb", "--tail=40", check=False).stdout
    assert len(refused) == 2 and all(r["retry_after"] for r in refused), f"{results}\n{lb_log}"
    assert_all_finished([r for r in results if r not in refused], MAX_PENDING)
    # KEDA woke on what Prometheus scraped from the activator: every held request counted
    peak = query(node, f"max_over_time({activator_pending_series(NAME, 'default')}[10m])")
    assert float(peak[0]["value"][1]) == MAX_PENDING, peak
    assert [ready(p) for p in engine_pods(node, NAME)] == [True]
    wait_for(lambda: routes(url), timeout=60, what="NGINX routing to the engine", interval=1)
    assert_all_finished(stream_runs(url, streams=2, max_tokens=MAX_TOKENS).results(), 2)

    try:
        wait_for(lambda: replicas(node), lambda r: r == 0, timeout=240, what="the scale back to zero when idle",
                 interval=3)
    except AssertionError as e:
        so = node.kubectl("get", "scaledobject", f"{NAME}-engine", "-o", "jsonpath={.status}").stdout
        raise AssertionError(f"{e}\nScaledObject status: {so}\n{node.diagnostics()}") from None
