"""Conditions that need the outside world, against the real control plane and the operator as it runs:

- Progressing=False/InsufficientGPU and the Auto rollout strategy, from a pod the scheduler could not place. No
  scheduler runs here: the test sets the pod's PodScheduled condition exactly as kube-scheduler writes it.
- MetricsAvailable, from a real Prometheus scraping a real activator and a real engine on loopback.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from e2e.cluster import stop_process_group
from e2e.loopback import Prometheus, wait_http
from e2e.test_operator import apply_manifest, condition, get, manifest, mark_pods_ready
from e2e.waiting import wait_for
from pagekube.operator.rollout import REPLACE, SURGE
from tests.server_process import ServerProcess, free_port

SCHEDULER_MESSAGE = ("0/1 nodes are available: 1 Insufficient nvidia.com/gpu. preemption: 0/1 nodes are available: "
                     "1 No preemption victims found for incoming pod.")


@pytest.fixture
def namespace(control_plane, request):
    ns = request.node.name.replace("_", "-")[:50].strip("-").lower()
    control_plane.kubectl("create", "namespace", ns)
    return ns


def engine_strategy(cp, ns, name) -> dict:
    return (get(cp, "deployment", f"{name}-engine", "-n", ns) or {}).get("spec", {}).get("strategy")


def test_a_pod_waiting_for_a_gpu_turns_auto_into_replace_and_stalls_progressing(control_plane, operator, namespace):
    cp, ns = control_plane, namespace
    apply_manifest(cp, manifest("gpus", ns, replicas=2, resources={"gpu": 1}))
    wait_for(lambda: engine_strategy(cp, ns, "gpus") == SURGE, what="Auto surges with 2 replicas")
    pods = wait_for(lambda: (p := get(cp, "pods", "-n", ns, "-l", "app.kubernetes.io/component=engine")["items"])
                    and len(p) == 2 and p, what="2 engine pods (the ReplicaSet controller made them)")
    # What kube-scheduler writes when no node has a free GPU.
    status = {"status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                         "message": SCHEDULER_MESSAGE}]}}
    cp.kubectl("patch", "pod", pods[0]["metadata"]["name"], "-n", ns, "--subresource=status", "--type=merge",
               "-p", json.dumps(status))
    stalled = wait_for(lambda: (c := condition(cp, ns, "gpus", "Progressing")).get("reason") == "InsufficientGPU" and c,
                       what="Progressing=False reason=InsufficientGPU")
    assert stalled["status"] == "False" and stalled["message"] == SCHEDULER_MESSAGE
    assert engine_strategy(cp, ns, "gpus") == REPLACE  # no spare GPU: one old pod goes, then its successor starts
    events = get(cp, "events", "-n", ns)["items"]
    print(f"\n[e2e] InsufficientGPU: strategy {engine_strategy(cp, ns, 'gpus')['rollingUpdate']}; "
          f"{len(events)} events in the namespace")
    # Once the pods are placed and ready, Auto goes back to surging.
    mark_pods_ready(cp, ns, "gpus")
    wait_for(lambda: condition(cp, ns, "gpus", "Progressing").get("reason") == "Complete", what="rollout complete")
    wait_for(lambda: engine_strategy(cp, ns, "gpus") == SURGE, what="Auto surges again")


@pytest.mark.skipif(not shutil.which("prometheus"), reason="prometheus (Debian package) is installed by scripts/test-deps.sh")
def test_metrics_available_proves_prometheus_answers_the_query_from_real_series(control_plane, operator, namespace,
                                                                                tmp_path):
    cp, ns, name = control_plane, namespace, "metered"
    engine_port, activator_port = free_port(), free_port()
    activator = subprocess.Popen(
        [sys.executable, "-m", "pagekube.operator.cli", "activator", "--llmdeployment", name, "--host", "127.0.0.1",
         "--port", str(activator_port), "--upstream", f"127.0.0.1:{engine_port}"],
        stdout=open(tmp_path / "activator.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    engine = prom = None
    try:
        wait_http(f"http://127.0.0.1:{activator_port}/activator/healthz")
        # Labelled as a ServiceMonitor or the scrape annotations would label them in a cluster.
        prom = Prometheus(tmp_path, [
            (f"127.0.0.1:{activator_port}", {"namespace": ns}, "/activator/metrics"),
            (f"127.0.0.1:{engine_port}", {"namespace": ns, "pod": f"{name}-engine-7d9f8c6b5-x2x4z"}, "/metrics"),
        ])
        autoscaling = {"enabled": True, "minReplicas": 0, "maxReplicas": 2, "prometheusAddress": prom.url}

        def metrics_condition(reason):
            return wait_for(lambda: (c := condition(cp, ns, name, "MetricsAvailable")).get("reason") == reason and c,
                            what=f"MetricsAvailable reason {reason}", timeout=60)

        apply_manifest(cp, manifest(name, ns, resources={"gpu": 1}, autoscaling=autoscaling))
        # At zero engines the activator's pending count is what wakes KEDA: it must be there.
        assert metrics_condition("SeriesFound")["status"] == "True"
        # An engine is ready (play kubelet) but nobody scrapes it yet: KEDA would read a constant 0.
        wait_for(lambda: mark_pods_ready(cp, ns, name) >= 1, what="pods")
        missing = metrics_condition("NoSeries")
        assert missing["status"] == "False" and "vllm:num_requests_waiting" in missing["message"]
        engine = ServerProcess("--dtype", "float32", "--kv-cache-memory", str(64 * 1024**2), port=engine_port,
                               log_path=tmp_path / "engine.log").wait_ready()
        found = metrics_condition("SeriesFound")
        assert "vllm:num_requests_waiting" in found["message"] and "activator_requests_pending" in found["message"]
        # A wrong address, and an address that is not a Prometheus.
        closed = f"http://127.0.0.1:{free_port()}"
        apply_manifest(cp, manifest(name, ns, resources={"gpu": 1}, autoscaling={**autoscaling, "prometheusAddress": closed}))
        unreachable = metrics_condition("PrometheusUnreachable")
        assert unreachable["status"] == "False" and closed in unreachable["message"]
        apply_manifest(cp, manifest(name, ns, resources={"gpu": 1},
                                    autoscaling={**autoscaling, "prometheusAddress": f"http://127.0.0.1:{activator_port}"}))
        assert metrics_condition("QueryFailed")["status"] == "False"
        reasons = {e["reason"] for e in get(cp, "events", "-n", ns)["items"] if e["type"] == "Warning"}
        print(f"\n[e2e] MetricsAvailable: {found['message']}; unreachable: {unreachable['message']}; "
              f"warning events: {sorted(reasons)}")
        assert {"NoSeries", "PrometheusUnreachable", "QueryFailed"} <= reasons
    finally:
        for part in (engine, prom):
            if part is not None:
                part.stop()
        stop_process_group(activator)
