"""The Pod Security Standard "restricted" for every pod the operator renders: a namespace that enforces it (as
production clusters do) admits them as they are. The pod carries the user and the seccomp profile; each container,
init containers included, drops every capability and cannot gain privileges."""

from __future__ import annotations


def pod_security_context(uid: int, fs_group: bool = False) -> dict:
    """A non-root user (the image's), and the container runtime's default seccomp profile."""
    context = {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "seccompProfile": {"type": "RuntimeDefault"}}
    if fs_group:  # volumes the pod writes (the model download) are then group-owned by its user
        context["fsGroup"] = uid
    return context


def container_security_context(read_only_root: bool) -> dict:
    """`read_only_root` where the process writes only to mounted volumes (its /tmp an emptyDir)."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": read_only_root}
