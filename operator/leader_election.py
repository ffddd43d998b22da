"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection does it: several operator replicas
run, one reconciles. The leader renews the Lease every `retry` seconds; the others take it over once it has gone
`lease` seconds without a renewal *that they saw* (their own clock, never the leader's timestamps, so clock skew
between nodes does not matter). A leader that cannot renew within `renew_deadline` stops leading: the process
exits (controller-runtime's behaviour) and comes back as a follower. On a clean stop the leader releases the Lease,
so a rolling update hands over at once instead of after `lease` seconds."""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("pagekube.operator")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # MicroTime


class LeaderElector:
    def __init__(self, api: client.ApiClient, namespace: str, name: str, identity: str, on_started: Callable[[], None],
                 on_lost: Callable[[], None], lease: float = 15.0, renew_deadline: float = 10.0, retry: float = 2.0):
        self.leases = client.CoordinationV1Api(api)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.on_started, self.on_lost = on_started, on_lost
        self.lease, self.renew_deadline, self.retry = lease, renew_deadline, retry
        self.leading = False
        self._seen: tuple | None = None  # (holder, renewTime) last read, and when we first saw it
        self._seen_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop campaigning; a leader releases the Lease so another replica takes over at once."""
        self._stop.set()
        self._thread.join(timeout=self.retry + 5)
        if self.leading:
            try:
                lease = self.leases.read_namespaced_lease(self.name, self.namespace)
                if lease.spec.holder_identity == self.identity:
                    lease.spec.holder_identity = ""
                    self.leases.replace_namespaced_lease(self.name, self.namespace, lease)
                    log.info("released the leader lease %s/%s", self.namespace, self.name)
            except ApiException as e:
                log.warning("could not release the leader lease: %s", e.reason)

    def _run(self) -> None:
        last_renewal = time.monotonic()
        while not self._stop.is_set():
            try:
                held = self._try_acquire_or_renew()
            except ApiException as e:  # a conflict (another replica wrote first) or an API server hiccup
                log.debug("leader election: %s", e.reason)
                held = False
            if held:
                last_renewal = time.monotonic()
                if not self.leading:
                    self.leading = True
                    log.info("became the leader (lease %s/%s, identity %s)", self.namespace, self.name, self.identity)
                    self.on_started()
            elif self.leading and time.monotonic() - last_renewal > self.renew_deadline:
                log.error("leader lease %s/%s not renewed within %.0f s: stopping", self.namespace, self.name,
                          self.renew_deadline)
                self.leading = False
                self.on_lost()
                return
            self._stop.wait(self.retry)

    def _try_acquire_or_renew(self) -> bool:
        now = _now()
        try:
            lease = self.leases.read_namespaced_lease(self.name, self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            body = client.V1Lease(metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                                  spec=client.V1LeaseSpec(holder_identity=self.identity, lease_duration_seconds=int(self.lease),
                                                          acquire_time=now, renew_time=now, lease_transitions=0))
            self.leases.create_namespaced_lease(self.namespace, body)
            return True
        spec = lease.spec
        record = (spec.holder_identity, spec.renew_time)
        if record != self._seen:
            self._seen, self._seen_at = record, time.monotonic()
        holder = spec.holder_identity or ""
        expired = time.monotonic() - self._seen_at > (spec.lease_duration_seconds or self.lease)
        if holder and holder != self.identity and not expired:
            return False
        if holder != self.identity:  # free (released) or expired: take it over
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
            spec.acquire_time = now
            spec.holder_identity = self.identity
        spec.renew_time = now
        spec.lease_duration_seconds = int(self.lease)
        self.leases.replace_namespaced_lease(self.name, self.namespace, lease)  # resourceVersion: a lost race 409s
        return True
