"""kopf wiring: passes for one LLMDeployment never overlap (a child's event and the parent's handler may fire at
once on kopf's worker threads); passes for different ones still run side by side."""

from __future__ import annotations

import threading
import time

from pagekube.operator import handlers
from pagekube.operator.reconciler import ReconcileResult


class SlowReconciler:
    def __init__(self):
        self.active: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.total_peak = 0
        self.lock = threading.Lock()

    def reconcile(self, body):
        name = body["metadata"]["name"]
        with self.lock:
            self.active[name] = self.active.get(name, 0) + 1
            self.peak[name] = max(self.peak.get(name, 0), self.active[name])
            self.total_peak = max(self.total_peak, sum(self.active.values()))
        time.sleep(0.2)
        with self.lock:
            self.active[name] -= 1
        return ReconcileResult()


def test_passes_for_one_llmdeployment_are_serialized(monkeypatch):
    fake = SlowReconciler()
    monkeypatch.setattr(handlers, "_reconciler", fake)
    bodies = [{"metadata": {"name": n, "namespace": "ns"}} for n in ("a", "a", "a", "b", "b")]
    threads = [threading.Thread(target=handlers._reconcile, args=(b, None)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake.peak == {"a": 1, "b": 1}
    assert fake.total_peak == 2  # a and b overlapped
