"""Two operator replicas on the real control plane, as the chart runs them (--leader-elect): one holds the Lease and
reconciles, the other waits; killed, the leader is replaced once its Lease expires; stopped cleanly, it releases
the Lease and a waiting replica takes over at once."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from e2e.cluster import stop_process_group
from e2e.conftest import start_operator
from e2e.test_operator import apply_manifest, get, manifest, resyncs
from e2e.waiting import wait_for
from tests.server_process import json_log_lines

NS = "leader-election"
LEASE_SECONDS = 15  # client-go's and controller-runtime's default, and ours


def holder(cp) -> str | None:
    r = cp.kubectl("get", "lease", "pagekube-operator", "-n", NS, "-o", "json", check=False)
    return json.loads(r.stdout)["spec"].get("holderIdentity") if r.returncode == 0 else None


def identity(op) -> str:
    for entry in json_log_lines(op.log_path):
        if m := re.search(r"identity (\S+)\)", entry.get("message", "")):
            return m.group(1)
    raise AssertionError(f"no identity logged: {op.log_path.read_text()[-2000:]}")


@pytest.fixture
def replicas(control_plane, tmp_path):
    control_plane.kubectl("create", "namespace", NS)
    started = []

    def start(i: int):
        op = start_operator(control_plane.env, tmp_path / f"operator-{i}.log", "--leader-elect",
                            f"--leader-election-namespace={NS}", f"--namespace={NS}")
        started.append(op)
        return op

    yield start
    for op in started:
        stop_process_group(op, grace=15)
    control_plane.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def test_one_replica_leads_a_killed_leader_is_replaced_and_a_stopped_one_hands_over(control_plane, replicas):
    cp = control_plane
    a, b = replicas(0), replicas(1)
    lead = wait_for(lambda: holder(cp), what="a leader")
    leader, follower = (a, b) if lead == identity(a) else (b, a)
    assert lead == identity(leader) != identity(follower)
    apply_manifest(cp, manifest("led", NS))
    wait_for(lambda: resyncs(leader, NS, "led") >= 2, what="the leader's passes")
    assert resyncs(follower, NS, "led") == 0  # the follower reconciles nothing (and writes nothing)

    # The leader's node dies (SIGKILL: no release): the follower takes over once the Lease has gone unrenewed.
    os.killpg(leader.pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: holder(cp) == identity(follower), timeout=LEASE_SECONDS + 15, what="the follower leading")
    takeover = time.monotonic() - killed
    cp.kubectl("delete", "service", "led-engine", "-n", NS)
    wait_for(lambda: get(cp, "service", "led-engine", "-n", NS) is not None, what="the new leader restoring a child")

    # A rolling update: a new replica waits; the leader stops cleanly and releases the Lease: handover at once.
    new = replicas(2)
    wait_for(lambda: identity(new), what="the new replica campaigning")
    sigterm = time.monotonic()
    stop_process_group(follower, grace=15)
    stopped = time.monotonic()
    assert stopped - sigterm < 10, "the operator outlived SIGTERM: a pod would be killed at its grace period"
    wait_for(lambda: holder(cp) == identity(new), timeout=10, what="the new replica leading")
    handover = time.monotonic() - stopped
    wait_for(lambda: resyncs(new, NS, "led") >= 1, what="the new leader's passes")
    print(f"\n[e2e] leader killed: replaced in {takeover:.1f} s (lease {LEASE_SECONDS} s); "
          f"leader stopped cleanly: handed over in {handover:.1f} s")
    assert takeover >= LEASE_SECONDS - 3  # it waited for the Lease to expire (not a split brain)
    assert handover < 8  # released, not expired
