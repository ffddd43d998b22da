"""An hf:// model without a pinned commit, against the real control plane and the operator as it runs: the first
pod's download step reports the commit it fetched (its termination message, which the test writes as the kubelet
would: no kubelet runs here), the operator records it in status.model and renders later pods with it; a new source
starts over."""

from __future__ import annotations

import json

import pytest

from e2e.test_operator import apply_manifest, get, manifest
from e2e.waiting import wait_for

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def namespace(control_plane, request):
    ns = request.node.name.replace("_", "-")[:50].strip("-").lower()
    control_plane.kubectl("create", "namespace", ns)
    return ns


def download_command(cp, ns, name) -> list[str]:
    deployment = get(cp, "deployment", f"{name}-engine", "-n", ns) or {}
    inits = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("initContainers") or [{}]
    return inits[0].get("command") or []


def model_status(cp, ns, name) -> dict:
    return ((get(cp, "llmd", name, "-n", ns) or {}).get("status") or {}).get("model") or {}


def test_an_hf_model_without_a_commit_is_pinned_to_the_one_the_first_download_fetched(control_plane, operator,
                                                                                       namespace):
    cp, ns, name = control_plane, namespace, "pinned"
    apply_manifest(cp, manifest(name, ns))  # hf://org/model, no revision: whatever the default branch holds
    assert wait_for(lambda: download_command(cp, ns, name)[3:5] == ["org/model", ""], what="the unpinned download")
    pod = wait_for(lambda: (p := get(cp, "pods", "-n", ns, "-l", "app.kubernetes.io/component=engine")["items"]) and p[0],
                   what="the first engine pod (the ReplicaSet controller made it)")
    # What the kubelet writes once the download step exits 0 with the commit in /dev/termination-log.
    finished = {"name": "model-download", "ready": True, "restartCount": 0, "image": "engine", "imageID": "",
                "state": {"terminated": {"exitCode": 0, "reason": "Completed", "message": COMMIT,
                                         "startedAt": "2026-12-06T00:00:00Z", "finishedAt": "2026-12-06T00:01:00Z"}}}
    cp.kubectl("patch", "pod", pod["metadata"]["name"], "-n", ns, "--subresource=status", "--type=merge",
               "-p", json.dumps({"status": {"initContainerStatuses": [finished]}}))
    wait_for(lambda: model_status(cp, ns, name).get("revision") == COMMIT, what="status.model.revision recorded")
    assert model_status(cp, ns, name) == {"source": "hf://org/model", "revision": COMMIT}
    wait_for(lambda: download_command(cp, ns, name)[3:5] == ["org/model", COMMIT], what="later pods pinned")
    # Another source: the old commit means nothing for it.
    apply_manifest(cp, manifest(name, ns, model={"name": name, "source": "hf://org/other"}))
    wait_for(lambda: download_command(cp, ns, name)[3:5] == ["org/other", ""], what="the new source, unpinned")
    wait_for(lambda: model_status(cp, ns, name) == {"source": "hf://org/other"}, what="status.model for the new source")
