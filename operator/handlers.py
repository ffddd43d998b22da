"""kopf handlers: thin wiring from events to Reconciler.reconcile (all logic lives in pure builders)."""

from __future__ import annotations

import collections
import logging
import os
import threading

import kopf
from kubernetes import client, config
from pydantic import ValidationError

from pagekube.operator import naming
from pagekube.operator.reconciler import Reconciler
from pagekube.operator.spec import GROUP, PLURAL, VERSION

RESYNC_SECONDS = float(os.environ.get("PAGEKUBE_RESYNC_SECONDS", "60"))  # `run --resync-seconds` sets it
log = logging.getLogger("pagekube.operator")
_reconciler: Reconciler | None = None
# kopf runs sync handlers on worker threads: a child's event and its parent's own handler may fire together.
# One pass per LLMDeployment at a time, so two passes never apply or prune over each other.
_passes: collections.defaultdict[tuple[str, str], threading.Lock] = collections.defaultdict(threading.Lock)
_passes_guard = threading.Lock()


def reconciler() -> Reconciler:
    global _reconciler
    if _reconciler is None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        _reconciler = Reconciler()
    return _reconciler


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300


def _pass_lock(body: dict) -> threading.Lock:
    with _passes_guard:
        return _passes[(body["metadata"]["namespace"], body["metadata"]["name"])]


def _reconcile(body: dict, logger) -> None:
    body = dict(body)
    try:
        with _pass_lock(body):
            result = reconciler().reconcile(body)
    except ValidationError as e:  # the schema should have refused it; say so instead of retrying forever
        kopf.warn(body, reason="InvalidSpec", message=str(e).replace("\n", " "))
        raise kopf.PermanentError(f"invalid spec: {e}") from e
    if result.problems and result.status is not None:  # only when the condition changes: no event storm
        kopf.warn(body, reason=result.problems[0][0], message="; ".join(m for _, m in result.problems))
    for cond in (result.status or {}).get("conditions", []):  # likewise once per change: KEDA would scale blind
        if cond["type"] == "MetricsAvailable" and cond["status"] == "False":
            kopf.warn(body, reason=cond["reason"], message=cond["message"])
    if result.writes:
        logger.info("reconciled: %s", ", ".join(result.writes))


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile_llmdeployment(body, logger, **_):
    _reconcile(body, logger)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def resync(body, logger, **_):
    """Periodic resync: picks up a Secret created later, a KEDA CRD installed later, drift of any kind."""
    _reconcile(body, logger)


def _child_changed(meta, namespace, logger, **_):
    """A child was edited, deleted or changed status: reconcile its owner (restores drift, refreshes status)."""
    owner = (meta.get("labels") or {}).get(naming.OWNER_LABEL)
    if not owner or not namespace:
        return
    try:
        parent = client.CustomObjectsApi(reconciler().api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, owner)
    except client.ApiException as e:
        if e.status == 404:
            return  # the owner is gone; the garbage collector takes its children
        raise
    if parent["metadata"].get("deletionTimestamp"):
        return
    _reconcile(parent, logger)


_OWNED = {"app.kubernetes.io/managed-by": naming.MANAGED_BY}
for _resource in [("apps", "v1", "deployments"), ("v1", "services"), ("v1", "configmaps")]:
    kopf.on.event(*_resource, labels=_OWNED)(_child_changed)
