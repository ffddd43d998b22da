"""The operator, run as `pagekube-operator run`, against a real kube-apiserver + etcd + kube-controller-manager.

No kubelet runs: where a test needs pods "ready" it patches their status as the kubelet would, and says so.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest
import yaml

from e2e.cluster import WRITE_VERBS
from e2e.waiting import wait_for
from pagekube.operator.cli import render
from pagekube.operator.reconciler import contains
from tests.k8s_tools import REPO
from tests.server_process import json_log_lines

CHILD_KINDS = "persistentvolumeclaims,deployments,services,configmaps,poddisruptionbudgets,networkpolicies,scaledobjects,servicemonitors,prometheusrules"


def get(cp, *args) -> dict | None:
    r = cp.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def condition(cp, ns, name, kind) -> dict:
    obj = get(cp, "llmd", name, "-n", ns) or {}
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == kind), {})


def children(cp, ns, name) -> list[dict]:
    out = get(cp, CHILD_KINDS, "-n", ns, "-l", f"serving.pagekube.io/llmdeployment={name}")
    return out["items"] if out else []


def mark_pods_ready(cp, ns, name):
    """What the kubelet would do once the containers pass their readiness probes: Running + Ready."""
    pods = get(cp, "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={name}")["items"]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = {"status": {"phase": "Running", "conditions": [
        {"type": t, "status": "True", "lastTransitionTime": now} for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]}}
    for pod in pods:
        cp.kubectl("patch", "pod", pod["metadata"]["name"], "-n", ns, "--subresource=status", "--type=merge",
                   "-p", json.dumps(status))
    return len(pods)


def apply_manifest(cp, manifest: str, check=True):
    return cp.kubectl("apply", "-f", "-", input=manifest, check=check)


def manifest(name, ns, **spec) -> str:
    doc = {"apiVersion": "serving.pagekube.io/v1alpha1", "kind": "LLMDeployment", "metadata": {"name": name, "namespace": ns},
           "spec": {"model": {"name": name, "source": "hf://org/model"}, **spec}}
    return yaml.safe_dump(doc)


def operator_requests(cp, ns, verbs=WRITE_VERBS) -> list[str]:
    """Requests in `ns` made by the operator (kopf or its kubernetes client), not by kubectl or the KCM."""
    return [f"{e['verb']} {e['objectRef'].get('resource')}/{e['objectRef'].get('name')}"
            for e in cp.requests(ns, verbs) if not e.get("userAgent", "").startswith(("kubectl", "kube-controller-manager"))]


def operator_writes(cp, ns) -> list[str]:
    return operator_requests(cp, ns)


def resyncs(op, ns, name) -> int:
    """Completed passes over one LLMDeployment, from the operator's JSON log."""
    return sum(e.get("message", "").startswith(f"reconciled {ns}/{name}:") for e in json_log_lines(op.log_path))


@pytest.fixture(scope="module")
def op(operator):
    return operator


@pytest.fixture
def namespace(control_plane, request):
    ns = request.node.name.replace("_", "-")[:50].strip("-").lower()
    control_plane.kubectl("create", "namespace", ns)
    return ns


def test_apply_examples_creates_owned_children_progressing_then_ready(control_plane, op):
    cp = control_plane
    cp.kubectl("apply", "-f", str(REPO / "examples"))
    # 3 Services, 1 ConfigMap, 2 Deployments, 2 PodDisruptionBudgets; llama-8b scales to zero: + ScaledObject,
    # the activator's Deployment, Service and ServiceMonitor, and the engine's ServiceMonitor and PrometheusRule
    expected = {"smollm2": 8, "qwen": 8, "llama-8b": 14}
    for name, count in expected.items():
        items = wait_for(lambda n=name, c=count: len(children(cp, "default", n)) == c and children(cp, "default", n),
                         what=f"{name}'s {count} children")
        uid = get(cp, "llmd", name)["metadata"]["uid"]
        for child in items:
            (ref,) = child["metadata"]["ownerReferences"]
            assert ref["uid"] == uid and ref["controller"] is True
    # What the operator applied is what `pagekube-operator render` prints for the same file.
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for want in render(list(yaml.safe_load_all(path.read_text()))):
            live = get(cp, want["kind"].lower(), want["metadata"]["name"], "-n", "default")
            assert live is not None and contains(live, want), f"{want['kind']}/{want['metadata']['name']}"
    wait_for(lambda: condition(cp, "default", "smollm2", "Progressing").get("status") == "True", what="Progressing")
    assert condition(cp, "default", "smollm2", "Ready")["status"] == "False"
    # Pods exist (kube-controller-manager made them) but nothing runs them: play kubelet.
    wait_for(lambda: mark_pods_ready(cp, "default", "smollm2") >= 3, what="smollm2 pods")  # 1 engine + 2 nginx
    ready = wait_for(lambda: condition(cp, "default", "smollm2", "Ready").get("status") == "True"
                     and condition(cp, "default", "smollm2", "Ready"), what="Ready")
    assert ready["reason"] == "Available" and condition(cp, "default", "smollm2", "Progressing")["status"] == "False"
    table = cp.kubectl("get", "llmd", "smollm2").stdout.split("\n")
    assert table[0].split() == ["NAME", "MODEL", "REPLICAS", "READY", "STATUS", "ENDPOINT", "AGE"]
    assert table[1].split()[:6] == ["smollm2", "SmolLM2-135M-Instruct", "1", "1", "Available",
                                    "http://smollm2-lb.default.svc.cluster.local/v1"]
    status = get(cp, "llmd", "smollm2")["status"]
    assert status["observedGeneration"] == get(cp, "llmd", "smollm2")["metadata"]["generation"]
    assert status["selector"] == "app.kubernetes.io/instance=smollm2,app.kubernetes.io/component=engine,serving.pagekube.io/llmdeployment=smollm2"


def test_resync_of_an_unchanged_resource_writes_nothing_and_drift_is_restored(control_plane, op, namespace):
    cp, ns = control_plane, namespace
    # Quantities the API server rewrites ("0.5" -> "500m", "1024Mi" -> "1Gi") must not look like drift.
    apply_manifest(cp, manifest("idem", ns, resources={"gpu": 1, "cpu": "0.5", "memory": "1024Mi"}))
    wait_for(lambda: len(children(cp, ns, "idem")) == 8, what="children")
    time.sleep(8)  # let the first status writes settle
    before, resyncs_before = len(operator_writes(cp, ns)), resyncs(op, ns, "idem")
    reads_before = len(operator_requests(cp, ns, ("get", "list")))
    time.sleep(10)
    passes = resyncs(op, ns, "idem") - resyncs_before
    assert passes >= 3  # --resync-seconds 3: full reconciles did run
    assert operator_writes(cp, ns)[before:] == []
    # Reads: one LIST per owned kind serves comparison and pruning (13-16 GETs + LISTs a pass before).
    reads = operator_requests(cp, ns, ("get", "list"))[reads_before:]
    print(f"operator reads per resync pass: {len(reads) / passes:.1f} ({sorted(set(reads))})")
    assert len(reads) <= 7 * (passes + 1), reads
    # Drift: a deleted Service and an edited ConfigMap come back as the operator wants them.
    want_conf = get(cp, "configmap", "idem-lb", "-n", ns)["data"]["nginx.conf"]
    cp.kubectl("delete", "service", "idem-engine", "-n", ns)
    cp.kubectl("patch", "configmap", "idem-lb", "-n", ns, "--type=merge", "-p", '{"data": {"nginx.conf": "events {}"}}')
    wait_for(lambda: get(cp, "service", "idem-engine", "-n", ns) is not None, what="Service restored")
    wait_for(lambda: get(cp, "configmap", "idem-lb", "-n", ns)["data"]["nginx.conf"] == want_conf, what="ConfigMap restored")


def test_spec_updates_reach_children_and_keda_owns_replicas(control_plane, op, namespace):
    cp, ns = control_plane, namespace
    apply_manifest(cp, manifest("upd", ns))
    wait_for(lambda: get(cp, "deployment", "upd-engine", "-n", ns), what="engine Deployment")

    def engine():
        return get(cp, "deployment", "upd-engine", "-n", ns)

    cp.kubectl("scale", "llmd", "upd", "-n", ns, "--replicas=2")  # the scale subresource
    wait_for(lambda: engine()["spec"]["replicas"] == 2, what="replicas 2 via kubectl scale llmd")
    apply_manifest(cp, manifest("upd", ns, engine={"maxNumSeqs": 64, "extraArgs": ["--seed", "7"]}, replicas=3))
    wait_for(lambda: engine()["spec"]["replicas"] == 3, what="replicas 3")
    args = wait_for(lambda: (a := engine()["spec"]["template"]["spec"]["containers"][0]["args"])
                    and "--seed" in a and a, what="new args")
    assert args[args.index("--max-num-seqs") + 1] == "64"
    apply_manifest(cp, manifest("upd", ns, autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 6}))
    so = wait_for(lambda: get(cp, "scaledobject", "upd-engine", "-n", ns), what="ScaledObject")
    assert so["spec"]["maxReplicaCount"] == 6

    def replica_managers():
        fields = get(cp, "deployment", "upd-engine", "-n", ns, "--show-managed-fields")["metadata"]["managedFields"]
        return {f["manager"] for f in fields if '"f:replicas"' in json.dumps(f.get("fieldsV1", {}).get("f:spec", {}))}

    wait_for(lambda: "pagekube-operator" not in replica_managers(), what="operator releasing spec.replicas")
    # "KEDA" (this test, through the scale subresource as the HPA does) scales to 5: the operator leaves it be.
    cp.kubectl("scale", "deployment", "upd-engine", "-n", ns, "--replicas=5")
    time.sleep(8)  # two resyncs
    assert engine()["spec"]["replicas"] == 5
    apply_manifest(cp, manifest("upd", ns, autoscaling={"enabled": False}, replicas=2))
    wait_for(lambda: get(cp, "scaledobject", "upd-engine", "-n", ns) is None, what="ScaledObject removed")
    wait_for(lambda: engine()["spec"]["replicas"] == 2, what="operator owns replicas again")


def test_the_network_policy_follows_its_switch(control_plane, op, namespace):
    cp, ns = control_plane, namespace
    apply_manifest(cp, manifest("np", ns, networkPolicy={"enabled": True, "monitoringNamespaces": ["obs"]}))
    policy = wait_for(lambda: get(cp, "networkpolicy", "np-engine", "-n", ns), what="the NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "engine"
    assert policy["spec"]["ingress"][1]["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"] == ["obs"]
    apply_manifest(cp, manifest("np", ns, networkPolicy={"enabled": False}))
    wait_for(lambda: get(cp, "networkpolicy", "np-engine", "-n", ns) is None, what="the NetworkPolicy removed")


def test_the_model_cache_claim_is_created_and_mounted(control_plane, op, namespace):
    cp, ns = control_plane, namespace
    apply_manifest(cp, manifest("cached", ns, model={"name": "cached", "source": "hf://org/model", "sizeHint": "2Gi",
                                                     "cache": {"enabled": True, "accessMode": "ReadWriteOnce"}}))
    claim = wait_for(lambda: get(cp, "pvc", "cached-model-cache", "-n", ns), what="the model cache claim")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert claim["metadata"]["ownerReferences"][0]["name"] == "cached"
    pod = wait_for(lambda: get(cp, "deployment", "cached-engine", "-n", ns), what="the engine")["spec"]["template"]["spec"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "cached-model-cache"}} in pod["volumes"]


def test_deleting_the_llmdeployment_garbage_collects_every_child(control_plane, op, namespace):
    cp, ns = control_plane, namespace
    apply_manifest(cp, manifest("gone", ns, autoscaling={"enabled": True}, monitoring={"serviceMonitor": True, "prometheusRule": True}))
    wait_for(lambda: len(children(cp, ns, "gone")) == 11, what="11 children")
    cp.kubectl("delete", "llmd", "gone", "-n", ns)
    wait_for(lambda: children(cp, ns, "gone") == [], timeout=90, what="garbage collection")


@pytest.mark.parametrize("spec, message", [
    ({"replicas": "two"}, 'spec.replicas: Invalid value: "string": spec.replicas in body must be of type integer'),
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas must be <= maxReplicas"),
    ({"model": {"name": "m", "source": "hf://o/r", "dtype": "float8"}}, 'spec.model.dtype: Unsupported value: "float8"'),
    ({"model": {"name": "m", "source": "gopher://x"}}, "spec.model.source in body should match"),
    ({"resources": {"gpu": 3}, "engine": {"tensorParallelSize": 2}}, "resources.gpu must be a multiple of engine.tensorParallelSize"),
    ({"engine": {"blockSize": 12}}, 'spec.engine.blockSize: Unsupported value: 12'),
    ({"engine": {"volumes": [{"name": "dshm", "emptyDir": {}}]}}, "the names models, dshm, adapters, api-key and adapter-claim-* are the operator's own"),
    ({"engine": {"volumeMounts": [{"name": "cache"}]}}, "spec.engine.volumeMounts[0].mountPath: Required value"),
    ({"adapters": [{"name": "a", "source": "hf://o/a"}, {"name": "a", "source": "hf://o/b"}]},
     "spec.adapters[1]: Duplicate value"),
    ({"adapters": [{"name": "bad", "source": "hf://o/a"}]}, "an adapter cannot take the model's own name"),
    ({"adapters": [{"name": "sql adapter", "source": "hf://o/a"}]}, "spec.adapters[0].name in body should match"),
    ({"adapters": [{"name": "a", "source": "hf://o/a"}], "engine": {"pipelineParallelSize": 2}},
     "LoRA with engine.pipelineParallelSize > 1 is not supported yet"),
    ({"engine": {"pipelineParallelSize": 0}}, "spec.engine.pipelineParallelSize in body should be greater than or equal to 1"),
    ({"loadBalancer": {"strategy": "RoundRobin"}}, 'spec.loadBalancer.strategy: Unsupported value: "RoundRobin"'),
    ({"loadBalancer": {"prefixHash": {"maxConnectionsPerReplica": 0}}},
     "spec.loadBalancer.prefixHash.maxConnectionsPerReplica: Invalid value: 0"),
    ({"monitoring": {"alertFor": {"PagekubeQueueDepth": "1m"}}}, "monitoring.alertFor: the alerts are PagekubeKVCacheSaturated"),
    ({"monitoring": {"alertFor": {"PagekubeEngineDown": "2 minutes"}}}, "spec.monitoring.alertFor.PagekubeEngineDown in body should match"),
])
def test_invalid_manifests_are_refused_by_the_api_server(control_plane, spec, message):
    doc = yaml.safe_load(manifest("bad", "default"))
    doc["spec"].update(spec)
    r = apply_manifest(control_plane, yaml.safe_dump(doc), check=False)
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert get(control_plane, "llmd", "bad") is None


def test_unservable_spec_is_degraded_with_an_event_and_the_operator_stays_healthy(control_plane, op, namespace):
    cp, ns = control_plane, namespace
    apply_manifest(cp, manifest("nokey", ns, auth={"apiKeySecretRef": {"name": "missing"}}))
    degraded = wait_for(lambda: condition(cp, ns, "nokey", "Degraded").get("status") == "True"
                        and condition(cp, ns, "nokey", "Degraded"), what="Degraded")
    assert degraded["reason"] == "SecretNotFound" and f"Secret {ns}/missing" in degraded["message"]
    assert condition(cp, ns, "nokey", "Ready")["status"] == "False"
    events = wait_for(lambda: [e for e in get(cp, "events", "-n", ns)["items"] if e["reason"] == "SecretNotFound"], what="Event")
    assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "nokey"
    time.sleep(8)  # several resyncs: no retry storm, one Event (counted, not repeated), operator alive
    assert len([e for e in get(cp, "events", "-n", ns)["items"] if e["reason"] == "SecretNotFound"]) == 1
    assert op.poll() is None
    with urllib.request.urlopen(op.liveness, timeout=5) as r:
        assert r.status == 200
    # Creating the Secret fixes it on the next resync.
    cp.kubectl("create", "secret", "generic", "missing", "-n", ns, "--from-literal=api-key=s3cret")
    wait_for(lambda: condition(cp, ns, "nokey", "Degraded").get("status") == "False", what="recovery")
    dep = wait_for(lambda: get(cp, "deployment", "nokey-engine", "-n", ns), what="engine Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "api-key", "secret": {"secretName": "missing", "items": [{"key": "api-key", "path": "api-key"}],
                                          "defaultMode": 420}} in pod["volumes"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--api-key-file") + 1] == "/var/run/secrets/pagekube/api-key"


def test_control_plane_binaries_come_from_the_cache(control_plane):
    """A second run of the build script builds nothing: the binaries are reused (keyed by version)."""
    r = subprocess.run([str(REPO / "e2e/controlplane/build.sh")], capture_output=True, text=True, check=True)
    assert "building" not in r.stderr and "fetching" not in r.stderr
    assert "k8s-v1.35.4-etcd-v3.6.5" in r.stdout
    assert control_plane.startup_seconds > 0


def test_gateway_inference_pool_is_created_and_pruned_on_the_api_server(control_plane, op, namespace):
    """The InferencePool CRD (Gateway API Inference Extension v1) is installed here: the operator creates the pool
    over the engine pods when gateway.inferencePool is set and deletes it when the field is cleared."""
    cp, ns = control_plane, namespace
    apply_manifest(cp, manifest("pooled", ns, gateway={"inferencePool": True, "endpointPicker": {"name": "epp"}}))
    pool = wait_for(lambda: get(cp, "inferencepools.inference.networking.k8s.io", "pooled", "-n", ns),
                    what="the InferencePool")
    assert pool["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "engine"
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9002}
    apply_manifest(cp, manifest("pooled", ns))
    wait_for(lambda: get(cp, "inferencepools.inference.networking.k8s.io", "pooled", "-n", ns) is None,
             what="the InferencePool pruned")
