"""The product where users meet it, on a real node: `kubectl apply` of an LLMDeployment, the operator running from
its image (installed by the Helm chart), engine pods from the engine image passing their real probes, NGINX from
its image in front, kube-proxy and CoreDNS between them, and requests that are never lost while pods come and go.

The tests run in order and share one LLMDeployment (a model load is the expensive part): served, rolled, a pod
deleted under load, then the whole thing deleted.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from e2e.node.conftest import ENGINE_IMAGE, LORA_ADAPTER_PATH, NGINX_IMAGE, RESTRICTED
from e2e.node.node import in_netns
from e2e.waiting import wait_for
from pagekube.kernels.cpu_ops import cpu_supports_bf16_dot

NAME = "cpu"
ADAPTER = "sql"  # a LoRA adapter every replica serves (the model_claim fixture writes it onto the claim)
BROKEN = "broken"  # declared, but its folder on the claim holds no adapter: every replica leaves it out
MAX_TOKENS = 48
LONG = 600  # tokens: streams that outlast a pod's startup, preStop and the start of its drain


def llmdeployment(replicas: int, name: str = NAME) -> dict:
    return {
        "apiVersion": "serving.pagekube.io/v1alpha1", "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "model": {"name": "SmolLM2-135M-Instruct", "source": "pvc://models/smollm2"},
            "adapters": [{"name": ADAPTER, "source": f"pvc://models/{LORA_ADAPTER_PATH}"},
                         {"name": BROKEN, "source": "pvc://models/adapters/missing"}],
            # One OpenMP thread per engine: two engines (three while a rollout surges) share this node's 2 cores.
            "engine": {"image": ENGINE_IMAGE, "maxNumSeqs": 16, "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]},
            "resources": {"gpu": 0, "memory": "3Gi"},
            "replicas": replicas,
            "loadBalancer": {"image": NGINX_IMAGE},
            # Long enough for a LONG stream to finish on a slow CPU: an AVX2-only one (float32, one thread) needed
            # more than 120 s for 600 tokens at 8 streams per engine, and the drain timeout aborted them (CI).
            "drain": {"timeoutSeconds": 300, "preStopDelaySeconds": 3},
        },
    }


def apply(node, replicas: int) -> None:
    node.kubectl("apply", "-f", "-", input=json.dumps(llmdeployment(replicas)))


def condition(node, kind: str, name: str = NAME) -> dict:
    r = node.kubectl("get", "llmd", name, "-o", "json", check=False)
    if r.returncode:
        return {}
    conds = json.loads(r.stdout).get("status", {}).get("conditions", [])
    return next((c for c in conds if c["type"] == kind), {})


def component_pods(node, component: str, name: str = NAME) -> list[dict]:
    out = node.kubectl("get", "pods", "-l", f"app.kubernetes.io/instance={name},app.kubernetes.io/component={component}",
                       "-o", "json").stdout
    return json.loads(out)["items"]


def engine_pods(node, name: str = NAME) -> list[dict]:
    return component_pods(node, "engine", name)


def ready(pod: dict) -> bool:
    """Ready and not on its way out (a terminating pod stays Ready until its drain fails the probe)."""
    return not pod["metadata"].get("deletionTimestamp") and any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def lb_url(node, name: str = NAME) -> str:
    ip = node.kubectl("get", "service", f"{name}-lb", "-o", "jsonpath={.spec.clusterIP}").stdout
    return f"http://{ip}/v1"


def routed_lb_url(node, name: str) -> str:
    """lb_url, once NGINX routes to the engine (it learns the pods' addresses on its next resolve)."""
    url = lb_url(node, name)
    wait_for(lambda: routes(url), timeout=30, what="NGINX routing to the engine", interval=0.5)
    return url


def engine_replicas(node, name: str) -> int:
    """The engine Deployment's desired replicas (what KEDA's HPA, or KEDA itself from zero, last wrote)."""
    return int(node.kubectl("get", "deployment", f"{name}-engine", "-o", "jsonpath={.spec.replicas}").stdout or 0)


def pod_metric(pod: dict, name: str) -> float:
    """One sample of an engine pod's /metrics, read from inside the node's network namespace."""
    out = subprocess.run(in_netns("curl", "-s", f"http://{pod['status']['podIP']}:8000/metrics"),
                         capture_output=True, text=True, timeout=10).stdout
    return sum(float(line.split()[-1]) for line in out.splitlines() if line.startswith(name + "{"))


def assert_all_finished(results: list[dict], streams: int, max_tokens: int = MAX_TOKENS) -> None:
    lost = [r for r in results if r.get("error") or r.get("finish_reason") != "length"
            or r.get("completion_tokens") != max_tokens]
    assert len(results) == streams and not lost, f"streams lost or cut: {lost}"


def chat(url: str, model: str, key: str | None = None) -> tuple[int, dict]:
    """A chat completion through NGINX, from inside the node's network namespace: (HTTP status, body)."""
    body = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Users older than 30?"}]}
    auth = ["-H", f"Authorization: Bearer {key}"] if key else []
    r = subprocess.run(in_netns("curl", "-s", "-w", "\n%{http_code}", "-H", "Content-Type: application/json", *auth,
                                "-d", json.dumps(body), f"{url}/chat/completions"), capture_output=True, text=True,
                       timeout=120)
    text, _, code = r.stdout.rpartition("\n")
    return int(code or 0), json.loads(text) if text.startswith("{") else {}


@pytest.fixture(scope="module")
def served(node, operator_release, model_claim):
    apply(node, replicas=1)
    try:
        wait_for(lambda: (condition(node, "Ready"), condition(node, "Progressing")),
                 lambda conds: conds[0].get("status") == "True", timeout=300, what="Ready=True", interval=2)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{node.diagnostics()}") from None
    url = lb_url(node)
    # Ready means the engine pods are ready; NGINX learns their addresses when it next resolves the headless
    # Service (its resolver's valid=5s on top of CoreDNS's 5 s TTL), so the first seconds after Ready can be 502.
    routed_after = time.monotonic()
    wait_for(lambda: routes(url), timeout=30, what="NGINX routing to the engine", interval=0.5)
    print(f"\n[node] LLMDeployment Ready; NGINX routed to the engine {time.monotonic() - routed_after:.1f} s later")
    return url


def routes(url: str) -> bool:
    r = subprocess.run(in_netns("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"{url}/models"),
                       capture_output=True, text=True, timeout=10)
    return r.stdout == "200"


def test_apply_serves_a_chat_completion_through_nginx_and_kube_proxy(node, served, stream_runs):
    pods = engine_pods(node)
    assert len(pods) == 1 and ready(pods[0])
    engine = pods[0]["spec"]["containers"][0]
    assert engine["image"] == ENGINE_IMAGE and engine["command"] == ["pagekube", "serve"]
    # Ready came from the real probes: the kubelet's startup/readiness checks on /health
    assert pods[0]["status"]["containerStatuses"][0]["started"] is True
    # The image's compiled CPU kernels run in the pod (built into the image, not skipped for want of a compiler).
    version = json.loads(subprocess.run(in_netns("curl", "-s", f"http://{pods[0]['status']['podIP']}:8000/version"),
                                        capture_output=True, text=True, timeout=10).stdout)
    if cpu_supports_bf16_dot():
        assert version["kernels"]["dtype"] == "bfloat16" and "linear" in version["kernels"]["cpu_kernels"], version
    printed = node.kubectl("get", "llmd", NAME).stdout
    assert "http://cpu-lb.default.svc.cluster.local/v1" in printed, printed
    run = stream_runs(served, streams=2, max_tokens=MAX_TOKENS)
    results = run.results()
    assert_all_finished(results, 2)
    # Streamed, not one final blob: most tokens arrive as their own chunk. Not all: with ignore_eos the model may
    # run past <|im_end|> into special tokens, which stream as empty deltas (seen: 45 of 48 with text).
    assert all(r["chunks"] >= MAX_TOKENS // 2 and r["completion_tokens"] == MAX_TOKENS for r in results), results


def test_the_lora_adapter_serves_through_nginx(node, served):
    code, body = chat(served, ADAPTER)
    assert code == 200 and body["model"] == ADAPTER and body["choices"][0]["message"]["content"], body
    models = json.loads(subprocess.run(in_netns("curl", "-s", f"{served}/models"), capture_output=True, text=True,
                                       timeout=30).stdout)
    assert {m["id"]: m["parent"] for m in models["data"]}[ADAPTER] == "SmolLM2-135M-Instruct"
    assert chat(served, "no-such-adapter")[0] == 404
    assert chat(served, BROKEN)[0] == 404  # left out by the engine; the model and the good adapter serve


def adapters_status(node) -> tuple[list[dict] | None, dict]:
    status = json.loads(node.kubectl("get", "llmd", NAME, "-o", "json").stdout).get("status") or {}
    return status.get("adapters"), next((c for c in status.get("conditions", []) if c["type"] == "AdaptersReady"), {})


def test_status_counts_the_replicas_serving_each_adapter_and_names_the_broken_one(node, served):
    """The operator, in its pod, reads each ready engine pod's /metrics over the pod network."""
    adapters, cond = wait_for(lambda: adapters_status(node), lambda s: s[1].get("reason") == "AdapterFailed",
                              timeout=60, what="AdaptersReady=False reason=AdapterFailed")
    ready_pods = [p for p in engine_pods(node) if ready(p)]
    assert adapters[0] == {"name": ADAPTER, "readyReplicas": len(ready_pods)}, adapters
    assert adapters[1]["name"] == BROKEN and adapters[1]["readyReplicas"] == 0
    assert "no adapter_config.json" in adapters[1]["message"], adapters
    assert f"'{BROKEN}' failed to load on {len(ready_pods)} of {len(ready_pods)} ready replicas" in cond["message"]
    assert condition(node, "Ready")["status"] == "True"
    print(f"\n[node] AdaptersReady: {cond['message']}")


def test_the_restricted_namespace_admits_every_pod_the_operator_renders(node, served):
    """The namespace enforces the "restricted" Pod Security Standard (e2e/node/conftest.py): the real API server
    refuses a pod that breaks it, and admitted every engine and NGINX pod of this LLMDeployment."""
    labels = json.loads(node.kubectl("get", "namespace", "default", "-o", "json").stdout)["metadata"]["labels"]
    assert labels.get(RESTRICTED[0]) == RESTRICTED[1]
    plain = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain", "namespace": "default"},
             "spec": {"containers": [{"name": "c", "image": NGINX_IMAGE}]}}
    refused = node.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(plain), check=False)
    assert refused.returncode != 0 and 'violates PodSecurity "restricted' in refused.stderr, refused.stderr
    for component in ("engine", "load-balancer"):
        pods = component_pods(node, component)
        assert pods and all(ready(p) for p in pods), component
        assert pods[0]["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    events = node.kubectl("get", "events", "--field-selector", "reason=FailedCreate", "-o", "json").stdout
    assert json.loads(events)["items"] == []


def test_rolling_restart_under_load_loses_no_stream_and_the_new_pods_serve_the_lora_adapter(node, served, stream_runs):
    apply(node, replicas=2)
    wait_for(lambda: [ready(p) for p in engine_pods(node)], lambda r: r == [True, True], timeout=300,
             what="two ready engine pods", interval=2)
    before = {p["metadata"]["name"] for p in engine_pods(node)}
    run = stream_runs(served, streams=16, max_tokens=LONG)
    run.wait_first_tokens(16)
    node.kubectl("rollout", "restart", f"deployment/{NAME}-engine")
    # The kubelet's preStop + SIGTERM reach an old pod while streams still run on it: that is the drain under test.
    wait_for(lambda: [p for p in engine_pods(node) if p["metadata"]["name"] in before
                      and p["metadata"].get("deletionTimestamp")], timeout=300, what="an old pod terminating")
    finished_by_then = sum(e["event"] == "result" for e in run.events)
    results = run.results()
    assert finished_by_then < 16, "every stream ended before the rollout reached an old pod: nothing was drained"
    assert_all_finished(results, 16, LONG)
    node.kubectl("rollout", "status", f"deployment/{NAME}-engine", "--timeout=400s", timeout=420)
    after = {p["metadata"]["name"] for p in engine_pods(node) if ready(p)}
    assert len(after) == 2 and not after & before, (before, after)
    # Every replica loads every adapter at start: the restarted ones serve it (NGINX may take a resolve to see them)
    wait_for(lambda: chat(served, ADAPTER)[0], lambda code: code == 200, timeout=60, what="the adapter after the rollout")
    wait_for(lambda: adapters_status(node)[0], lambda a: a and a[0] == {"name": ADAPTER, "readyReplicas": 2},
             timeout=60, what="status.adapters: both new replicas serve the adapter")


def test_deleting_a_busy_pod_drains_it_and_others_take_new_requests(node, served, stream_runs):
    apply(node, replicas=2)  # as the rollout test left it (run alone, this test scales up itself)
    wait_for(lambda: [ready(p) for p in engine_pods(node)], lambda r: r == [True, True], timeout=300,
             what="two ready engine pods", interval=2)
    run = stream_runs(served, streams=8, max_tokens=LONG)
    run.wait_first_tokens(8)
    pods = engine_pods(node)
    victim = max(pods, key=lambda p: pod_metric(p, "vllm:num_requests_running"))
    assert pod_metric(victim, "vllm:num_requests_running") > 0
    node.kubectl("delete", "pod", victim["metadata"]["name"], "--wait=false")
    gone = victim["metadata"]["name"]
    wait_for(lambda: [ready(p) for p in engine_pods(node) if p["metadata"]["name"] == gone], lambda r: r != [True],
             timeout=30, what="the deleted pod out of the endpoints")
    late = stream_runs(served, streams=4, max_tokens=MAX_TOKENS)
    assert_all_finished(late.results(), 4)
    assert_all_finished(run.results(), 8, LONG)


def test_a_node_drain_stops_at_the_disruption_budget_and_leaves_an_engine_serving(node, served, stream_runs):
    """`kubectl drain` evicts one engine pod (maxUnavailable 1); its replacement cannot start on the cordoned node,
    so the budget refuses the second eviction: the drain times out with one engine still serving."""
    apply(node, replicas=2)
    wait_for(lambda: [ready(p) for p in engine_pods(node)], lambda r: r == [True, True], timeout=300,
             what="two ready engine pods", interval=2)
    try:
        drain = node.kubectl("drain", node.name, "--pod-selector=app.kubernetes.io/component=engine",
                             "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=40s", check=False, timeout=90)
        assert drain.returncode != 0, drain.stdout
        assert "disruption budget" in drain.stderr + drain.stdout, drain.stderr
        wait_for(lambda: [ready(p) for p in engine_pods(node)], lambda r: r.count(True) == 1, timeout=60,
                 what="one engine pod left serving")
        assert_all_finished(stream_runs(served, streams=2, max_tokens=MAX_TOKENS).results(), 2)
    finally:
        node.kubectl("uncordon", node.name)
    wait_for(lambda: [ready(p) for p in engine_pods(node)], lambda r: r == [True, True], timeout=300,
             what="two ready engine pods again", interval=2)


def test_deleting_the_load_balancer_pod_mid_stream_loses_no_stream(node, served, stream_runs):
    """The kubelet runs NGINX's preStop (a graceful quit, waited for) before its SIGTERM, nginx's fast shutdown:
    streams already going through the deleted load balancer pod finish; its replacement takes new requests."""
    old = {p["metadata"]["name"] for p in component_pods(node, "load-balancer")}
    run = stream_runs(served, streams=4, max_tokens=LONG)
    run.wait_first_tokens(4)
    for name in old:
        node.kubectl("delete", "pod", name, "--wait=false")
    finished_by_then = sum(e["event"] == "result" for e in run.events)
    results = run.results()
    assert finished_by_then < 4, "every stream ended before the load balancer pod was deleted: nothing was tested"
    assert_all_finished(results, 4, LONG)
    wait_for(lambda: [ready(p) for p in component_pods(node, "load-balancer") if p["metadata"]["name"] not in old], lambda r: r and all(r),
             timeout=120, what="a new load balancer pod ready", interval=1)
    wait_for(lambda: routes(served), timeout=60, what="the new NGINX routing to the engines", interval=0.5)
    assert_all_finished(stream_runs(served, streams=2, max_tokens=MAX_TOKENS).results(), 2)


def test_deleting_the_llmdeployment_removes_every_child_and_pod(node, served):
    node.kubectl("delete", "llmd", NAME, "--wait=true", "--timeout=300s", timeout=320)
    selector = f"app.kubernetes.io/instance={NAME}"

    def leftovers() -> str:
        return node.kubectl("get", "deployments,replicasets,services,configmaps,pods", "-l", selector,
                            "-o", "name").stdout.strip()

    wait_for(leftovers, lambda left: left == "", timeout=300, what="no children left", interval=2)
