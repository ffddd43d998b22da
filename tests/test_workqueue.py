"""The operator's work queue (controller-runtime's semantics): one pass per key at a time, events coalesced into
one follow-up pass, different keys side by side, failed keys retried with exponential backoff."""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry

from pagekube.operator.workqueue import QueueMetrics, WorkQueue


def make_queue(**kw) -> tuple[WorkQueue, CollectorRegistry]:
    registry = CollectorRegistry()
    return WorkQueue(QueueMetrics(registry, "test"), **kw), registry


def metric(registry, name) -> float:
    return registry.get_sample_value(name, {"controller": "test", "name": "test"})


def run_workers(queue: WorkQueue, n: int, work) -> list[threading.Thread]:
    def loop():
        while (key := queue.get()) is not None:
            try:
                work(key)
            finally:
                queue.done(key)
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


class Passes:
    """Work that takes `seconds` and records each pass and the most passes that ran at once."""

    def __init__(self, seconds: float):
        self.seconds, self.done, self.active, self.peak, self.lock = seconds, [], 0, 0, threading.Lock()

    def __call__(self, key):
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        time.sleep(self.seconds)
        with self.lock:
            self.active -= 1
            self.done.append(key)


def test_a_burst_of_events_for_one_key_gives_a_handful_of_passes_never_two_at_once():
    queue, registry = make_queue()
    work = Passes(0.05)
    run_workers(queue, 4, work)
    for _ in range(100):
        queue.add(("ns", "a"))
        time.sleep(0.001)
    deadline = time.monotonic() + 5
    while (len(queue) or work.active) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    queue.shutdown()
    assert 1 <= len(work.done) <= 5, len(work.done)  # 100 events in ~0.1 s: each pass covers every event before it
    assert work.peak == 1
    assert metric(registry, "workqueue_adds_total") == len(work.done)


def test_different_keys_run_side_by_side():
    queue, _ = make_queue()
    work = Passes(0.2)
    run_workers(queue, 4, work)
    for name in "abcd":
        queue.add(("ns", name))
    deadline = time.monotonic() + 5
    while len(work.done) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    queue.shutdown()
    assert sorted(k[1] for k in work.done) == list("abcd") and work.peak == 4


def test_failures_back_off_exponentially_and_success_forgets_them():
    queue, registry = make_queue(base_delay=0.05, max_delay=0.2)
    delays = [queue.add_rate_limited("k") for _ in range(5)]
    assert delays == [0.05, 0.1, 0.2, 0.2, 0.2]
    assert metric(registry, "workqueue_retries_total") == 5
    queue.forget("k")
    assert queue.add_rate_limited("k") == 0.05


def test_add_after_keeps_the_earliest_time_and_delivers_then():
    queue, _ = make_queue()
    start = time.monotonic()
    queue.add_after("k", 0.3)
    queue.add_after("k", 5.0)  # later: ignored
    assert queue.get() == "k"
    assert 0.25 <= time.monotonic() - start < 2
    queue.done("k")
    queue.add_after("k", 5.0)
    queue.add_after("k", 0.1)  # earlier: wins
    start = time.monotonic()
    assert queue.get() == "k" and time.monotonic() - start < 1


def test_a_key_added_while_its_pass_runs_is_queued_once_after_it():
    queue, _ = make_queue()
    queue.add("k")
    assert queue.get() == "k"
    queue.add("k")
    queue.add("k")
    assert len(queue) == 0  # not while its pass runs
    queue.done("k")
    assert len(queue) == 1 and queue.get() == "k"
    queue.done("k")
    assert len(queue) == 0
