"""hf:// models pinned to one commit. The operator resolves no revision itself: the download step resolves the spec's
revision (a branch, a tag, or none: the default branch) to a commit, downloads that commit and reports it as its
termination message; the operator records it in status.model and renders later pods with that commit, so replicas
started days apart serve the same weights. A spec that names a commit is pinned already; a new source starts over."""

from __future__ import annotations

import re

from pagekube.operator.spec import LLMDeploymentSpec

DOWNLOAD_CONTAINER = "model-download"
COMMIT = re.compile(r"^[0-9a-f]{40}$")


def _downloads(pod: dict, repo: str, requested: str) -> bool:
    """Whether `pod`'s download step fetches `repo` at `requested` (pods of an older spec may still be around)."""
    for container in (pod.get("spec") or {}).get("initContainers") or []:
        if container.get("name") == DOWNLOAD_CONTAINER:
            return (container.get("command") or [])[3:5] == [repo, requested]
    return False


def reported_commit(pods: list[dict], spec: LLMDeploymentSpec) -> str | None:
    """The commit a finished download step of one of `pods` (those downloading the spec's source and revision)
    reported as its termination message, if any."""
    repo = spec.model.source.removeprefix("hf://")
    for pod in pods:
        if not _downloads(pod, repo, spec.model.revision or ""):
            continue
        for status in (pod.get("status") or {}).get("initContainerStatuses") or []:
            done = (status.get("state") or {}).get("terminated") or {}
            message = (done.get("message") or "").strip()
            if status.get("name") == DOWNLOAD_CONTAINER and done.get("exitCode") == 0 and COMMIT.match(message):
                return message
    return None


def pinned_commit(spec: LLMDeploymentSpec, status: dict | None, pods: list[dict]) -> str | None:
    """The commit later pods download: the one status recorded for this source, else one a pod just reported;
    None where the spec pins the revision itself or the source is not hf://."""
    if not spec.model.source.startswith("hf://") or (spec.model.revision and COMMIT.match(spec.model.revision)):
        return None
    recorded = (status or {}).get("model") or {}
    if recorded.get("source") == spec.model.source and recorded.get("requested") == spec.model.revision:
        if COMMIT.match(recorded.get("revision") or ""):
            return recorded["revision"]
    return reported_commit(pods, spec)


def pinned_spec(spec: LLMDeploymentSpec, commit: str | None) -> LLMDeploymentSpec:
    """`spec` with its model's revision set to `commit` (as the pods see it)."""
    if commit is None:
        return spec
    return spec.model_copy(update={"model": spec.model.model_copy(update={"revision": commit})})


def model_status(spec: LLMDeploymentSpec, commit: str | None) -> dict:
    """status.model: the source, the revision the spec asked for (None: the default branch) and the commit (None:
    not known yet). None removes a key the status had (the status is written as a merge patch)."""
    pinned = commit or (spec.model.revision if COMMIT.match(spec.model.revision or "") else None)
    return {"source": spec.model.source, "requested": spec.model.revision, "revision": pinned}
