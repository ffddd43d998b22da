"""Kubernetes Events on an LLMDeployment (what `kubectl describe llmd` shows), as core/v1 Events."""

from __future__ import annotations

import datetime
import logging
import uuid

from kubernetes import client

log = logging.getLogger("pagekube.operator")
COMPONENT = "pagekube-operator"


def post_event(core: client.CoreV1Api, body: dict, reason: str, message: str, type_: str = "Warning") -> None:
    meta = body["metadata"]
    now = datetime.datetime.now(datetime.timezone.utc)
    event = client.CoreV1Event(
        metadata=client.V1ObjectMeta(name=f"{meta['name']}.{uuid.uuid4().hex[:16]}", namespace=meta["namespace"]),
        involved_object=client.V1ObjectReference(api_version=body["apiVersion"], kind=body["kind"], name=meta["name"],
                                                 namespace=meta["namespace"], uid=meta["uid"],
                                                 resource_version=meta.get("resourceVersion")),
        reason=reason, message=message[:1024], type=type_, count=1, first_timestamp=now, last_timestamp=now,
        source=client.V1EventSource(component=COMPONENT), reporting_component=COMPONENT, reporting_instance=COMPONENT)
    try:
        core.create_namespaced_event(meta["namespace"], event)
    except client.ApiException as e:  # an Event is best effort: the status condition says the same
        log.warning("could not post Event %s on %s/%s: %s", reason, meta["namespace"], meta["name"], e.reason)
