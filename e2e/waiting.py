"""Polling, the one way the e2e tests wait for something to become true."""

from __future__ import annotations

import time


def wait_for(read, ok=bool, timeout: float = 45.0, what: str = "condition", interval: float = 0.5):
    """Call `read` until `ok(value)` holds; return that value. Fails naming `what` and the last value read."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} (last value: {value!r})"[:500])
        time.sleep(interval)


def wait_established(kubectl, *crds: str, timeout: float = 60.0) -> None:
    """`kubectl wait --for=condition=Established` on `crds` (its arguments: names, or "crd", "--all") until it
    succeeds: right after an apply it errors out on a CRD whose status has no conditions yet ("accessor error:
    <nil> is of the type <nil>"), rather than waiting (seen once starting the control plane)."""
    wait_for(lambda: kubectl("wait", "--for=condition=Established", "--timeout=10s", *crds, check=False).returncode == 0,
             timeout=timeout, what=f"{' '.join(crds)} established")
