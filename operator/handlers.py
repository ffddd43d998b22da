"""kopf wiring: kopf is the process's runtime (logging, the liveness probe); the controller (controller.py) does
the work on its own threads, from watch-fed caches and a coalescing work queue, with no per-event handlers."""

from __future__ import annotations

import logging
import os

import kopf
from kubernetes import client, config
from prometheus_client import CollectorRegistry, start_http_server

from pagekube.operator.controller import Controller

# `pagekube-operator run` sets these before importing this module.
RESYNC_SECONDS = float(os.environ.get("PAGEKUBE_RESYNC_SECONDS", "600"))
WORKERS = int(os.environ.get("PAGEKUBE_WORKERS", "4"))
NAMESPACES = [n for n in os.environ.get("PAGEKUBE_NAMESPACES", "").split(",") if n]
METRICS_ADDRESS = os.environ.get("PAGEKUBE_METRICS_BIND_ADDRESS", "0.0.0.0:8383")
log = logging.getLogger("pagekube.operator")
_controller: Controller | None = None


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
    _controller = Controller(api_client(), NAMESPACES or None, RESYNC_SECONDS, WORKERS, registry)
    _controller.start()


@kopf.on.cleanup()
def stop(**_):
    if _controller is not None:
        _controller.stop()


@kopf.on.probe(id="queue_depth")
def queue_depth(**_):
    return len(_controller.queue) if _controller is not None else None
