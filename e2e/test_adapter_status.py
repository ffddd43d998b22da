"""status.adapters and AdaptersReady against the real control plane, from a real engine's /metrics.

No kubelet runs here: the test writes the engine pod's status as the kubelet would (Running, Ready, its pod IP),
and the pod's IP is a loopback address where a real `pagekube serve` listens on the engine port. That engine serves
one good adapter and fails to load a bad one (an adapter for another base model), as a replica would."""

from __future__ import annotations

import json
import random
import time

import pytest

from e2e.test_operator import apply_manifest, condition, get, manifest
from e2e.waiting import wait_for
from pagekube.engine.model.model_files import resolve_model_dir
from pagekube.operator import naming
from tests.conftest import write_tiny_llama
from tests.lora_adapters import ATTENTION, write_adapter
from tests.server_process import ServerProcess


@pytest.fixture
def namespace(control_plane, request):
    ns = request.node.name.replace("_", "-")[:50].strip("-").lower()
    control_plane.kubectl("create", "namespace", ns)
    return ns


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A real engine on a loopback address of its own, at the port the engine pods declare."""
    d = tmp_path_factory.mktemp("adapters")
    bundled = resolve_model_dir(None)
    base = write_tiny_llama(d / "base", bundled)
    other = write_tiny_llama(d / "other", bundled, hidden_size=32, intermediate_size=64)
    good = write_adapter(base, d / "sql", ATTENTION, seed=1)
    bad = write_adapter(other, d / "foreign", ATTENTION)
    host = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}.{random.randint(1, 254)}"
    srv = ServerProcess(str(base), "--served-model-name", "tiny", "--dtype", "float32", "--enable-lora",
                        "--lora-modules", f"sql={good}", f"foreign={bad}", host=host, port=naming.ENGINE_PORT)
    try:
        yield srv.wait_ready(), host
    finally:
        srv.stop()


def mark_pod_ready_at(cp, ns: str, pod: dict, ip: str) -> None:
    """What the kubelet writes once the engine container passes its readiness probe."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "conditions": [
        {"type": t, "status": "True", "lastTransitionTime": now}
        for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
        "containerStatuses": [{"name": "engine", "ready": True, "restartCount": 0, "image": "pagekube",
                               "imageID": "", "started": True, "state": {"running": {"startedAt": now}}}]}}
    cp.kubectl("patch", "pod", pod["metadata"]["name"], "-n", ns, "--subresource=status", "--type=merge",
               "-p", json.dumps(status))


def adapters_status(cp, ns, name) -> list[dict] | None:
    return ((get(cp, "llmdeployment", name, "-n", ns) or {}).get("status") or {}).get("adapters")


def test_status_counts_replicas_per_adapter_and_a_bad_adapter_is_a_condition(control_plane, operator, namespace,
                                                                               engine):
    cp, ns, name = control_plane, namespace, "tuned"
    _, ip = engine
    adapters = [{"name": "sql", "source": "file:///adapters/sql"}, {"name": "foreign", "source": "file:///adapters/f"}]
    # Surge: a spec change adds a pod (never ready here: no kubelet) and keeps the ready one, so what that pod
    # serves stays readable; Auto would Replace at one replica, deleting it at once (CI once read that in between).
    surge = {"strategy": "Surge"}
    apply_manifest(cp, manifest(name, ns, adapters=adapters, rollout=surge))
    pending = wait_for(lambda: condition(cp, ns, name, "AdaptersReady"), what="AdaptersReady before any pod is ready")
    assert (pending["status"], pending["reason"]) == ("Unknown", "NoReadyEngines")
    def engine_pods() -> list[dict]:
        return get(cp, "pods", "-n", ns, "-l", naming.engine_pods_selector(name))["items"]

    (pod,) = wait_for(engine_pods, what="the engine pod (the ReplicaSet controller made it)")
    mark_pod_ready_at(cp, ns, pod, ip)

    failed = wait_for(lambda: (c := condition(cp, ns, name, "AdaptersReady")).get("reason") == "AdapterFailed" and c,
                      what="AdaptersReady=False reason=AdapterFailed")
    assert failed["status"] == "False" and "'foreign' failed to load on 1 of 1 ready replicas" in failed["message"]
    assert "another base model" in failed["message"], failed["message"]
    sql, foreign = adapters_status(cp, ns, name)
    assert sql == {"name": "sql", "readyReplicas": 1}
    assert foreign["name"] == "foreign" and foreign["readyReplicas"] == 0 and "another base model" in foreign["message"]
    assert condition(cp, ns, name, "Ready")["status"] == "True"  # a bad adapter blocks no one else
    print(f"\n[e2e] AdaptersReady: {failed['message']}")

    # Dropping the bad adapter from the spec: the pod still running serves the one left, and says so.
    apply_manifest(cp, manifest(name, ns, adapters=adapters[:1], rollout=surge))
    wait_for(lambda: len(engine_pods()) == 2, what="the surge pod beside the ready one")
    served = wait_for(lambda: (c := condition(cp, ns, name, "AdaptersReady")).get("status") == "True" and c,
                      what="AdaptersReady=True once only sql is declared")
    assert served["reason"] == "AllAdaptersServed" and adapters_status(cp, ns, name) == [{"name": "sql", "readyReplicas": 1}]

    # No adapters: the status keeps no adapter list and no AdaptersReady condition.
    apply_manifest(cp, manifest(name, ns, adapters=[], rollout=surge))
    wait_for(lambda: adapters_status(cp, ns, name) is None and not condition(cp, ns, name, "AdaptersReady"),
             what="no status.adapters and no AdaptersReady without adapters")
