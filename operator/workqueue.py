"""A rate-limited work queue of object keys, as controller-runtime's: events for one key coalesce into one pass.

A key added while it waits is not added twice; a key added while its pass runs is marked dirty and queued once
when the pass ends (so two passes of one object never run at once, and a burst of events costs one follow-up
pass, not one each). Failed keys come back after an exponential backoff; `add_after` schedules a key later (the
jittered resync), keeping only the earliest time per key.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Hashable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

Key = Hashable


class QueueMetrics:
    """controller-runtime's workqueue metrics (labels `controller` and `name`), so its dashboards read them."""

    def __init__(self, registry: CollectorRegistry, name: str):
        labels, values = ["controller", "name"], (name, name)
        self.depth = Gauge("workqueue_depth", "Current depth of the work queue", labels, registry=registry).labels(*values)
        self.adds = Counter("workqueue_adds_total", "Keys added to the work queue", labels, registry=registry).labels(*values)
        self.retries = Counter("workqueue_retries_total", "Keys re-added after a failure", labels,
                               registry=registry).labels(*values)
        buckets = (1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.1, 1, 10, 100, 1000)
        self.queue_duration = Histogram("workqueue_queue_duration_seconds", "Time a key waits before its pass",
                                        labels, buckets=buckets, registry=registry).labels(*values)
        self.work_duration = Histogram("workqueue_work_duration_seconds", "Time a pass takes", labels,
                                       buckets=buckets, registry=registry).labels(*values)


class WorkQueue:
    def __init__(self, metrics: QueueMetrics, base_delay: float = 0.5, max_delay: float = 300.0):
        self.metrics = metrics
        self.base_delay, self.max_delay = base_delay, max_delay
        self._cond = threading.Condition()
        self._queue: deque[Key] = deque()
        self._added_at: dict[Key, float] = {}  # keys waiting in _queue, and when they were added
        self._processing: dict[Key, float] = {}  # keys whose pass runs, and when it started
        self._dirty: set[Key] = set()  # added while processing: queued again when done
        self._later: list[tuple[float, Key]] = []  # (due, key) heap; stale entries are skipped
        self._due: dict[Key, float] = {}
        self._failures: dict[Key, int] = {}
        self._shut = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)

    def add(self, key: Key) -> None:
        with self._cond:
            self._add(key)

    def _add(self, key: Key, count: bool = True) -> None:
        if key in self._added_at or key in self._dirty:
            return  # already waiting: this event is covered by that pass
        if count:  # a dirty key queued again when its pass ends was counted when it was added
            self.metrics.adds.inc()
        if key in self._processing:
            self._dirty.add(key)
            return
        self._added_at[key] = time.monotonic()
        self._queue.append(key)
        self.metrics.depth.set(len(self._queue))
        self._cond.notify()

    def add_after(self, key: Key, delay: float) -> None:
        due = time.monotonic() + delay
        with self._cond:
            if self._due.get(key, float("inf")) <= due:
                return
            self._due[key] = due
            heapq.heappush(self._later, (due, key))
            self._cond.notify()

    def add_rate_limited(self, key: Key) -> float:
        """Re-add a failed key after 0.5 s, 1 s, 2 s, ... up to max_delay; returns the delay."""
        with self._cond:
            n = self._failures.get(key, 0)
            self._failures[key] = n + 1
        delay = min(self.base_delay * 2**n, self.max_delay)
        self.metrics.retries.inc()
        self.add_after(key, delay)
        return delay

    def forget(self, key: Key) -> None:
        """The key's pass succeeded: its next failure starts the backoff over."""
        with self._cond:
            self._failures.pop(key, None)

    def failures(self, key: Key) -> int:
        with self._cond:
            return self._failures.get(key, 0)

    def get(self) -> Key | None:
        """The next key to process (blocks); None once shut down. Call `done(key)` when its pass ends."""
        with self._cond:
            while True:
                now = time.monotonic()
                while self._later and self._later[0][0] <= now:
                    due, key = heapq.heappop(self._later)
                    if self._due.get(key) == due:
                        del self._due[key]
                        self._add(key)
                if self._queue:
                    key = self._queue.popleft()
                    self.metrics.queue_duration.observe(now - self._added_at.pop(key))
                    self.metrics.depth.set(len(self._queue))
                    self._processing[key] = now
                    return key
                if self._shut:
                    return None
                self._cond.wait(self._later[0][0] - now if self._later else None)

    def done(self, key: Key) -> None:
        with self._cond:
            started = self._processing.pop(key, None)
            if started is not None:
                self.metrics.work_duration.observe(time.monotonic() - started)
            if key in self._dirty:
                self._dirty.discard(key)
                self._add(key, count=False)

    def shutdown(self) -> None:
        with self._cond:
            self._shut = True
            self._cond.notify_all()
