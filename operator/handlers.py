"""kopf wiring: kopf is the process's runtime (logging, the liveness probe); the controller (controller.py) does
the work on its own threads, from watch-fed caches and a coalescing work queue, with no per-event handlers."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from pathlib import Path

import kopf
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from pagekube.operator.controller import Controller
from pagekube.operator.crd_upgrade import upgrade_crd
from pagekube.operator.leader_election import LeaderElector

# `pagekube-operator run` sets these before importing this module.
RESYNC_SECONDS = float(os.environ.get("PAGEKUBE_RESYNC_SECONDS", "600"))
WORKERS = int(os.environ.get("PAGEKUBE_WORKERS", "4"))
NAMESPACES = [n for n in os.environ.get("PAGEKUBE_NAMESPACES", "").split(",") if n]
METRICS_ADDRESS = os.environ.get("PAGEKUBE_METRICS_BIND_ADDRESS", "0.0.0.0:8383")
LEADER_ELECT = os.environ.get("PAGEKUBE_LEADER_ELECT") == "1"
MANAGE_CRD = os.environ.get("PAGEKUBE_MANAGE_CRD") == "1"
LEADER_ELECTION_ID = os.environ.get("PAGEKUBE_LEADER_ELECTION_ID", "pagekube-operator")
LEADER_ELECTION_NAMESPACE = os.environ.get("PAGEKUBE_LEADER_ELECTION_NAMESPACE", "")
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
log = logging.getLogger("pagekube.operator")
_controller: Controller | None = None
_elector: LeaderElector | None = None


def lease_namespace() -> str:
    """Where the Lease lives: the flag, else the pod's own namespace."""
    if LEADER_ELECTION_NAMESPACE:
        return LEADER_ELECTION_NAMESPACE
    if SERVICE_ACCOUNT_NAMESPACE.exists():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return os.environ.get("POD_NAMESPACE", "default")


def api_client() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


@kopf.on.startup()
def start(settings: kopf.OperatorSettings, **_):
    global _controller
    settings.posting.level = logging.INFO
    settings.scanning.disabled = True  # kopf watches nothing itself: no CRD scans, no namespace watches
    registry = CollectorRegistry()
    if METRICS_ADDRESS:
        host, _, port = METRICS_ADDRESS.rpartition(":")
        start_http_server(int(port), host or "0.0.0.0", registry=registry)
    api = api_client()
    if MANAGE_CRD:  # before the caches fill: objects are then read (and written) with the current schema
        try:
            upgrade_crd(api)
        except ApiException as e:  # no permission (older RBAC), the API server busy: serve with the CRD as it is
            log.warning("could not bring the CRD up to date (%s %s); continuing with the installed one", e.status, e.reason)
    _controller = Controller(api, NAMESPACES or None, RESYNC_SECONDS, WORKERS, registry)
    if not LEADER_ELECT:
        _controller.start()
        return
    global _elector
    leader = Gauge("leader_election_master_status", "1 while this replica leads (controller-runtime's name)",
                   ["name"], registry=registry).labels(LEADER_ELECTION_ID)

    def lead() -> None:
        leader.set(1)
        _controller.start()

    def lost() -> None:  # exit and come back as a follower: half-stopped reconcile state is never reused
        leader.set(0)
        os._exit(1)

    identity = f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    _elector = LeaderElector(api, lease_namespace(), LEADER_ELECTION_ID, identity, lead, lost)
    log.info("waiting to lead (lease %s/%s, identity %s)", _elector.namespace, LEADER_ELECTION_ID, identity)
    _elector.start()


@kopf.on.cleanup()
def stop(**_):
    if _controller is not None:
        _controller.stop()
    if _elector is not None:  # after the work stopped: the next leader starts from a clean slate
        _elector.stop()


@kopf.on.probe(id="queue_depth")
def queue_depth(**_):
    return len(_controller.queue) if _controller is not None else None
