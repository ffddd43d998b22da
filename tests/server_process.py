"""Start a real `pagekube serve` process on a free loopback port, and stop it (no process left behind)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def json_log_lines(path: Path) -> list[dict]:
    """The JSON lines a live process has finished writing: the last line may still be half-written, so only lines
    ended by a newline count (other lines, such as a library's plain-text warnings, are skipped)."""
    text = path.read_text(errors="replace")
    complete = text[:text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.startswith("{")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, env: dict | None = None, log_path: Path | None = None, port: int | None = None,
                 host: str = "127.0.0.1"):
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path or Path(f"/tmp/pagekube-server-{self.port}.log")
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "pagekube.engine.server", *args, "--port", str(self.port), "--host", host]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.send_signal(signal.SIGTERM)  # second signal: exit at once
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`, from a /metrics text page."""
    from prometheus_client.parser import text_string_to_metric_families

    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
                found = True
    if not found:
        raise KeyError(name)
    return total
