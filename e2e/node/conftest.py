"""Fixtures of the real-node suite: the node itself, the operator installed by its Helm chart from its image, and
the bundled model on a hostPath PersistentVolume."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

from e2e.node.node import Node, in_netns
from tests.k8s_tools import REPO

RESTRICTED = ("pod-security.kubernetes.io/enforce", "restricted")

OPERATOR_IMAGE = ("localhost/pagekube-operator", "dev")
ENGINE_IMAGE = "localhost/pagekube-engine:cpu"
NGINX_IMAGE = "localhost/nginx:sid"
LORA_ADAPTER_PATH = "adapters/sql"  # on the models claim: a PEFT LoRA adapter for the bundled model


@pytest.fixture(scope="session")
def node(tmp_path_factory, pytestconfig):
    n = Node(tmp_path_factory.mktemp("node"))
    try:
        n.start()
        # As in a production cluster: the API server's PodSecurity admission judges every pod the tests' namespaces
        # get (the LLMDeployments' in default, the operator's in pagekube-system) by the "restricted" profile.
        for ns in ("default", "pagekube-system"):
            n.kubectl("create", "namespace", ns, check=False)
            n.kubectl("label", "--overwrite", "namespace", ns, f"{RESTRICTED[0]}={RESTRICTED[1]}")
        reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
        if reporter:
            t = n.timings
            reporter.write_line(f"\n[node] builds/images checked in {t['build']:.0f} s, images imported in "
                                f"{t['images']:.0f} s, node Ready with CoreDNS in {t['cluster']:.1f} s")
        yield n
    finally:
        n.stop()


@pytest.fixture(scope="session")
def operator_release(node, prometheus):
    """`helm install` of charts/pagekube with the locally built operator image (the chart's own RBAC), its
    ServiceMonitor scraped by the node's Prometheus."""
    repo, tag = OPERATOR_IMAGE
    node.helm("install", "pagekube", str(REPO / "charts/pagekube"), "-n", "pagekube-system", "--create-namespace",
              "--set", f"image.repository={repo}", "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never",
              "--set", "metrics.serviceMonitor.enabled=true", "--wait", "--timeout", "180s")
    yield "pagekube"
    node.helm("uninstall", "pagekube", "-n", "pagekube-system", "--wait")


@pytest.fixture(scope="session")
def model_claim(node):
    """PersistentVolumeClaim `models` holding the bundled model (converted to a Hugging Face folder) at smollm2/,
    and a random LoRA adapter for it (PEFT's format) at LORA_ADAPTER_PATH."""
    from pagekube.engine.model.model_files import resolve_model_dir
    from tests.lora_adapters import write_adapter

    root = node.workdir / "models"
    shutil.copytree(resolve_model_dir(None), root / "smollm2")
    write_adapter(root / "smollm2", root / LORA_ADAPTER_PATH, ["q_proj", "v_proj"], r=8, seed=5)
    folders = [root, root / "smollm2", root / "adapters", root / LORA_ADAPTER_PATH]
    for path in folders:  # the engine runs as uid 1000; the cached conversion is root's, 0600
        path.chmod(0o755)
    for f in [f for d in folders[1:] for f in d.iterdir() if f.is_file()]:
        f.chmod(0o644)
    node.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "models"},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "local",
                  "hostPath": {"path": str(root), "type": "Directory"}, "claimRef": {"namespace": "default", "name": "models"}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models", "namespace": "default"},
         "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "local", "volumeName": "models",
                  "resources": {"requests": {"storage": "1Gi"}}}}]}))
    return "models"


class StreamRun:
    """stream_client.py running inside the node's network namespace, read line by line."""

    def __init__(self, base_url: str, streams: int, max_tokens: int):
        self.proc = subprocess.Popen(
            in_netns(sys.executable, "-m", "e2e.node.stream_client", "--base-url", base_url,
                     "--streams", str(streams), "--max-tokens", str(max_tokens)),
            cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.streams, self.events = streams, []

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"stream client ended early (rc {self.proc.wait()}): {self.events}")
        self.events.append(json.loads(line))
        return self.events[-1]

    def wait_first_tokens(self, count: int) -> None:
        while sum(e["event"] == "first" for e in self.events) < count:
            self._read()

    def results(self, timeout: float = 600) -> list[dict]:
        deadline = time.monotonic() + timeout
        while sum(e["event"] == "result" for e in self.events) < self.streams:
            assert time.monotonic() < deadline, "streams did not end in time"
            self._read()
        self.proc.wait(30)
        return sorted((e for e in self.events if e["event"] == "result"), key=lambda e: e["stream"])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def stream_runs():
    runs: list[StreamRun] = []
    yield lambda *a, **kw: runs.append(StreamRun(*a, **kw)) or runs[-1]
    for r in runs:
        r.kill()


@pytest.fixture(scope="session")
def prometheus(node):
    """prometheus-operator and a Prometheus it runs (e2e/node/monitoring.py); the URL KEDA queries."""
    from e2e.node.monitoring import start_monitoring

    return start_monitoring(node)


@pytest.fixture(scope="session")
def keda(node, prometheus):
    """The KEDA operator and metrics adapter, started once for the tests that autoscale; Prometheus's URL."""
    from e2e.node.autoscaling import start_autoscaling

    start_autoscaling(node, node.tools["PAGEKUBE_KEDA_BIN"])
    return prometheus


@pytest.fixture(scope="session")
def leaderworkerset(node):
    """The LeaderWorkerSet controller (and its CRD and webhooks), started once for the multi-node tests."""
    from e2e.node.leaderworkerset import start_leaderworkerset

    start_leaderworkerset(node, node.tools["PAGEKUBE_LWS_BIN"])
