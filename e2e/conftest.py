"""Session fixtures for the e2e tests: a real control plane, and the operator run as its real entrypoint."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from e2e.cluster import ControlPlane, stop_process_group
from tests.server_process import free_port


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory, pytestconfig):
    cp = ControlPlane(tmp_path_factory.mktemp("controlplane"))
    try:
        cp.start()
        reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
        if reporter:
            reporter.write_line(f"\n[e2e] control plane (etcd + kube-apiserver + kube-controller-manager) ready in "
                                f"{cp.startup_seconds:.1f} s; binaries from the cache")
        yield cp
    finally:
        cp.stop()


def start_operator(env: dict, log_path: Path, *args: str) -> subprocess.Popen:
    """`pagekube-operator run` in a subprocess, as a cluster would run it (kopf, JSON logs); waits for liveness."""
    port, metrics_port = free_port(), free_port()
    log = open(log_path, "w")
    exe = Path(sys.executable).parent / "pagekube-operator"
    proc = subprocess.Popen([str(exe), "run", "--resync-seconds=3", f"--liveness=http://127.0.0.1:{port}/healthz",
                             f"--metrics-bind-address=127.0.0.1:{metrics_port}", *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"operator did not start: {log_path.read_text()[-3000:]}") from None
            time.sleep(0.3)
    proc.log_path = log_path
    proc.liveness = f"http://127.0.0.1:{port}/healthz"
    proc.metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    return proc


@pytest.fixture(scope="module")
def operator(control_plane, tmp_path_factory):
    """The operator with the admin kubeconfig, for one test module (others may run their own)."""
    proc = start_operator(control_plane.env, Path(tmp_path_factory.mktemp("operator")) / "operator.log")
    yield proc
    stop_process_group(proc, grace=15)


def _live_children() -> list[str]:
    """Processes this pytest started that are still running (not zombies)."""
    me, found = str(os.getpid()), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            cmdline = (stat.parent / "cmdline").read_text().replace("\0", " ")[:200]
            # multiprocessing's resource tracker (started once per interpreter by the TP tests' spawned workers)
            # belongs to pytest itself and exits with it: not something a fixture forgot to stop.
            if "multiprocessing.resource_tracker" not in cmdline:
                found.append(cmdline)
    return found


def pytest_sessionfinish(session, exitstatus):
    """The e2e run must leave no process behind: every fixture has stopped what it started by now."""
    left = _live_children()
    if left:
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(f"[e2e] processes left behind: {left}", red=True)
        session.exitstatus = 1
