"""Every pod the operator renders passes the Pod Security Standard "restricted" (baseline included), as written in
https://kubernetes.io/docs/concepts/security/pod-security-standards/ — the checks below follow that page's rules,
not the operator's constants. The real node suite runs the same pods under the API server's own PodSecurity
admission (e2e/node: the test namespace enforces "restricted")."""

from __future__ import annotations

import pytest
import yaml

from pagekube.operator.cli import render
from tests.k8s_tools import EXAMPLES

# Baseline: capabilities a container may add; restricted: only NET_BIND_SERVICE, after dropping ALL.
RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                           "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}


def restricted_violations(pod: dict) -> list[str]:
    """What the "restricted" profile forbids in a pod spec (an empty list: admitted)."""
    out = []
    pod_sc = pod.get("securityContext") or {}
    containers = [*pod.get("initContainers", []), *pod.get("containers", []), *pod.get("ephemeralContainers", [])]
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"pod: {field}")
    for sysctl in pod_sc.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            out.append(f"pod: sysctl {sysctl['name']}")
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            out.append(f"volume {v['name']}: {sorted(kinds - RESTRICTED_VOLUME_TYPES)}")
    if pod_sc.get("runAsUser") == 0:
        out.append("pod: runAsUser 0")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    if pod_seccomp not in (None, "RuntimeDefault", "Localhost"):
        out.append(f"pod: seccompProfile {pod_seccomp}")
    for c in containers:
        name, sc = c["name"], c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{name}: runAsNonRoot must be true (pod or container)")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost (pod or container), not {seccomp}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities {caps['add']}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount")
    return out


def pods(objects: list[dict]) -> list[tuple[str, dict]]:
    return [(f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"])
            for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet")]


def llmdeployment(name: str, **spec) -> dict:
    return {"apiVersion": "serving.pagekube.io/v1alpha1", "kind": "LLMDeployment", "metadata": {"name": name},
            "spec": {"model": {"name": "m", "source": "hf://org/repo"}, **spec}}


SPECS = {
    "cpu": llmdeployment("cpu", resources={"gpu": 0, "cpu": "2", "memory": "4Gi"}),
    "scale-to-zero": llmdeployment("zero", autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 4}),
    "tensor-parallel": llmdeployment("tp", resources={"gpu": 4}, engine={"tensorParallelSize": 4}),
    "hf-revision": llmdeployment("hf", model={"name": "m", "source": "hf://org/repo", "revision": "main"}),
    "s3": llmdeployment("s3", model={"name": "m", "source": "s3://bucket/model"}),
    "pvc": llmdeployment("pvc", model={"name": "m", "source": "pvc://models/llama"}),
}


def test_the_checker_catches_each_rule():
    good = {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                             "capabilities": {"drop": ["ALL"]}}}],
            "volumes": [{"name": "v", "emptyDir": {}}]}
    assert restricted_violations(good) == []
    bad = yaml.safe_load(yaml.safe_dump(good))
    bad["securityContext"].pop("seccompProfile")
    bad["volumes"].append({"name": "h", "hostPath": {"path": "/"}})
    bad["initContainers"] = [{"name": "init"}]
    found = " | ".join(restricted_violations(bad))
    for rule in ("c: seccompProfile", "volume h", "init: allowPrivilegeEscalation", "init: capabilities"):
        assert rule in found, found


@pytest.mark.parametrize("source", [*(e.name for e in EXAMPLES), *SPECS])
def test_every_rendered_pod_passes_the_restricted_profile(source):
    documents = list(yaml.safe_load_all(next(e for e in EXAMPLES if e.name == source).read_text())) \
        if source.endswith(".yaml") else [SPECS[source]]
    rendered = pods(render(documents))
    assert rendered, "nothing rendered: nothing checked"
    for what, pod in rendered:
        assert restricted_violations(pod) == [], what
