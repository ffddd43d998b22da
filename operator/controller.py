"""The controller: watch-fed caches, a coalescing work queue, and a bounded pool of workers running passes.

Events only queue the owner's key (an LLMDeployment's change at once, a child's after CHILD_EVENT_DELAY, so a
burst is one pass); a worker takes the key, reads the LLMDeployment and its children from the caches and runs one
pass (reconciler.py), which writes only what differs. A pass that fails is retried with exponential backoff; each success schedules the next resync of that
object after `resync_seconds` plus up to 10% jitter, so a thousand objects' resyncs do not fire together. In steady
state the operator sends the API server nothing but its open watches.
"""

from __future__ import annotations

import logging
import random
import threading
import time

from kubernetes import client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagekube.operator import naming
from pagekube.operator.events import post_event
from pagekube.operator.informer import Informer, wait_synced
from pagekube.operator.model_revision import reported_commit
from pagekube.operator.reconciler import OWNED_KINDS, Reconciler
from pagekube.operator.spec import GROUP, KIND, PLURAL, VERSION, LLMDeploymentSpec
from pagekube.operator.workqueue import QueueMetrics, WorkQueue

log = logging.getLogger("pagekube.operator")
CONTROLLER = "llmdeployment"
PLURALS = {"Service": "services", "ConfigMap": "configmaps", "Deployment": "deployments",
           "ScaledObject": "scaledobjects", "ServiceMonitor": "servicemonitors", "PrometheusRule": "prometheusrules",
           "PodDisruptionBudget": "poddisruptionbudgets", "NetworkPolicy": "networkpolicies",
           "PersistentVolumeClaim": "persistentvolumeclaims", "InferencePool": "inferencepools",
           "LeaderWorkerSet": "leaderworkersets"}
MANAGED = f"app.kubernetes.io/managed-by={naming.MANAGED_BY}"
CHILD_EVENT_DELAY = 0.5  # seconds; drift is still restored well within 2 s


class ControllerMetrics:
    """controller-runtime's names, so dashboards and alerts written for Go operators read them unchanged."""

    def __init__(self, registry: CollectorRegistry):
        self.reconciles = Counter("controller_runtime_reconcile_total", "Reconciliations per controller and result",
                                  ["controller", "result"], registry=registry)
        self.errors = Counter("controller_runtime_reconcile_errors_total", "Reconciliation errors per controller",
                              ["controller"], registry=registry).labels(CONTROLLER)
        self.time = Histogram("controller_runtime_reconcile_time_seconds", "Time per reconciliation", ["controller"],
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                              registry=registry).labels(CONTROLLER)
        self.active = Gauge("controller_runtime_active_workers", "Workers running a reconciliation", ["controller"],
                            registry=registry).labels(CONTROLLER)
        self.max_workers = Gauge("controller_runtime_max_concurrent_reconciles", "Workers per controller",
                                 ["controller"], registry=registry).labels(CONTROLLER)
        self.requests = Counter("rest_client_requests_total", "HTTP requests to the API server, by method and code",
                                ["code", "method", "host"], registry=registry)
        for result in ("success", "error", "requeue"):
            self.reconciles.labels(CONTROLLER, result)


def count_requests(api: client.ApiClient, requests: Counter) -> None:
    """Count every request the client sends (rest_client_requests_total), watches included."""
    rest = api.rest_client
    send = rest.request
    host = api.configuration.host

    def counted(method, url, *args, **kwargs):
        try:
            response = send(method, url, *args, **kwargs)
        except client.ApiException as e:
            requests.labels(str(e.status), method, host).inc()
            raise
        except Exception:
            requests.labels("<error>", method, host).inc()
            raise
        requests.labels(str(response.status), method, host).inc()
        return response

    rest.request = counted


class Controller:
    def __init__(self, api: client.ApiClient, namespaces: list[str] | None, resync_seconds: float,
                 workers: int, registry: CollectorRegistry, crd_recheck_seconds: float = 60.0):
        self.metrics = ControllerMetrics(registry)
        count_requests(api, self.metrics.requests)
        self.queue = WorkQueue(QueueMetrics(registry, CONTROLLER))
        self.resync_seconds, self.workers = resync_seconds, workers
        scopes = namespaces or [None]
        self.parents = [Informer(api, f"{GROUP}/{VERSION}", KIND, PLURAL, ns, None, None, self._parent_changed)
                        for ns in scopes]
        self.children: dict[tuple[str, str], list[Informer]] = {
            (api_version, kind): [Informer(api, api_version, kind, PLURALS[kind], ns, MANAGED, naming.OWNER_LABEL,
                                           self._child_changed, crd_recheck_seconds, self._kind_served)
                                  for ns in scopes]
            for api_version, kind in OWNED_KINDS}
        # Engine pods, for the GPU check only (a pod the scheduler cannot place): cached, never listed per pass.
        self.pods = [Informer(api, "v1", "Pod", "pods", ns, f"{MANAGED},{naming.ENGINE_PODS}",
                              naming.OWNER_LABEL, self._pod_changed) for ns in scopes]
        self.reconciler = Reconciler(api, cache=self)
        self._stop = threading.Event()

    # ---- what the reconciler reads -------------------------------------------------------------------------
    def parent(self, namespace: str, name: str) -> dict | None:
        for informer in self.parents:
            if (obj := informer.get(namespace, name)) is not None:
                return obj
        return None

    def live_children(self, namespace: str, owner: str) -> dict[tuple[str, str], dict | None]:
        """{(apiVersion, kind): {name: object}} of one LLMDeployment's children; None for a kind not served."""
        live = {}
        for kind, informers in self.children.items():
            if not any(i.served for i in informers):
                live[kind] = None
                continue
            live[kind] = {}
            for informer in informers:
                live[kind].update(informer.owned_by(namespace, owner))
        return live

    def engine_pods(self, namespace: str, owner: str) -> list[dict]:
        return [pod for informer in self.pods for pod in informer.owned_by(namespace, owner).values()]

    # ---- events ----------------------------------------------------------------------------------------------
    def _parent_changed(self, event: str, obj: dict) -> None:
        if event != "DELETED":
            self.queue.add((obj["metadata"]["namespace"], obj["metadata"]["name"]))

    def _child_changed(self, event: str, obj: dict) -> None:
        """Children change in bursts (a rollout moves a Deployment's status many times): their owner's pass waits
        CHILD_EVENT_DELAY, and every event in that window is covered by the one pass."""
        owner = (obj["metadata"].get("labels") or {}).get(naming.OWNER_LABEL)
        if owner:
            self.queue.add_after((obj["metadata"]["namespace"], owner), CHILD_EVENT_DELAY)

    def _kind_served(self) -> None:
        """A CRD was installed after the operator started (KEDA, prometheus-operator): every LLMDeployment gets a
        pass now, so those waiting on it (MissingCRD) get their children without waiting for their resync."""
        for informer in self.parents:
            for key in informer.keys():
                self.queue.add(key)

    def _pod_changed(self, event: str, pod: dict) -> None:
        """Pods change often: only one the scheduler cannot place (the Unschedulable condition) or one whose hf://
        download reported the commit its owner has not recorded yet wakes its owner."""
        if event == "DELETED":
            return
        status = pod.get("status") or {}
        if any(c.get("reason") == "Unschedulable" for c in status.get("conditions") or []) or self._unrecorded_commit(pod):
            self._child_changed(event, pod)

    def _unrecorded_commit(self, pod: dict) -> bool:
        meta = pod["metadata"]
        owner = self.parent(meta["namespace"], (meta.get("labels") or {}).get(naming.OWNER_LABEL, ""))
        try:
            spec = LLMDeploymentSpec.model_validate((owner or {}).get("spec") or {})
        except ValueError:  # an invalid spec: its own pass reports that
            return False
        commit = reported_commit([pod], spec) if owner else None
        return commit is not None and ((owner.get("status") or {}).get("model") or {}).get("revision") != commit

    # ---- running ---------------------------------------------------------------------------------------------
    def informers(self) -> list[Informer]:
        return [*self.parents, *self.pods, *(i for group in self.children.values() for i in group)]

    def start(self, sync_timeout: float = 60.0) -> None:
        informers = self.informers()
        for informer in informers:
            informer.start()
        if not wait_synced(informers, sync_timeout):
            log.warning("caches not synced within %.0f s; starting anyway", sync_timeout)
        self.metrics.max_workers.set(self.workers)
        for i in range(self.workers):
            threading.Thread(target=self._work, name=f"reconcile-{i}", daemon=True).start()
        log.info("controller started: %d workers, resync every %.0f s, watching %s", self.workers,
                 self.resync_seconds, ", ".join(i.path for i in self.parents))

    def stop(self) -> None:
        self._stop.set()
        self.queue.shutdown()
        for informer in self.informers():
            informer.stop()

    def _work(self) -> None:
        while (key := self.queue.get()) is not None:
            try:
                self._process(key)
            finally:
                self.queue.done(key)

    def _process(self, key: tuple[str, str]) -> None:
        namespace, name = key
        body = self.parent(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.queue.forget(key)  # gone: the garbage collector takes its children
            return
        self.metrics.active.inc()
        start = time.monotonic()
        try:
            result = self.reconciler.reconcile(body)
            self._report(body, result)
        except Exception as e:  # noqa: BLE001 - one object's failure must not stop the others
            self.metrics.errors.inc()
            self.metrics.reconciles.labels(CONTROLLER, "error").inc()
            delay = self.queue.add_rate_limited(key)
            log.warning("reconcile of %s/%s failed (%s: %s); retrying in %.1f s", namespace, name,
                        type(e).__name__, e, delay)
            return
        finally:
            self.metrics.time.observe(time.monotonic() - start)
            self.metrics.active.dec()
        self.metrics.reconciles.labels(CONTROLLER, "success").inc()
        self.queue.forget(key)
        self.queue.add_after(key, self.resync_seconds * (1 + 0.1 * random.random()))
        log.info("reconciled %s/%s: %s", namespace, name, ", ".join(result.writes) or "no writes")

    def _report(self, body: dict, result) -> None:
        """Warning Events, only when the status changed (so a resync never repeats one): what keeps the spec from
        running, and a MetricsAvailable=False (KEDA would scale blind)."""
        if result.status is None:
            return
        if result.problems:
            post_event(self.reconciler.core, body, result.problems[0][0], "; ".join(m for _, m in result.problems))
        for cond in result.status.get("conditions", []):
            if cond["type"] == "MetricsAvailable" and cond["status"] == "False":
                post_event(self.reconciler.core, body, cond["reason"], cond["message"])
