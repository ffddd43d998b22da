"""Real nginx and Prometheus processes on loopback for the serving e2e tests (each stopped by the test that
started it). nginx runs the operator's own rendered config and router script; only upstream addresses, the listen port and
the script's folder differ."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

from e2e.waiting import wait_for
from pagekube.operator.nginx import SCRIPT_KEY, prefix_route_script, render_nginx_conf
from pagekube.operator.spec import LLMDeploymentSpec
from tests.server_process import ServerProcess, free_port, metric


def prefix_cache_counts(engines: list[ServerProcess]) -> list[tuple[float, float]]:
    """Each engine's (vllm:prefix_cache_queries, vllm:prefix_cache_hits) so far, in tokens."""
    pages = [httpx.get(e.url + "/metrics").text for e in engines]
    return [(metric(p, "vllm:prefix_cache_queries_total"), metric(p, "vllm:prefix_cache_hits_total")) for p in pages]


@contextmanager
def engine_replicas(count: int, args: list[str], workdir: Path, env: dict | None = None,
                    timeout: float = 180) -> Iterator[list[ServerProcess]]:
    """`count` engines (`pagekube serve ARGS`), all ready; stopped on exit. Logs: workdir/engine<i>.log."""
    procs = [ServerProcess(*args, log_path=workdir / f"engine{i}.log", env=env) for i in range(count)]
    try:
        for p in procs:
            p.wait_ready(timeout)
        yield procs
    finally:
        for p in procs:
            p.stop()


def wait_http(url, timeout=30.0):
    def ok():
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ok, timeout=timeout, what=url, interval=0.2)


class Nginx:
    def __init__(self, workdir: Path, spec: LLMDeploymentSpec, upstreams: list[str], backups: list[str] = ()):
        self.dir, self.port, self.spec, self.backups = workdir, free_port(), spec, list(backups)
        self.write(upstreams)
        self.proc = subprocess.Popen(self.command("-g", "daemon off;"), stdout=open(workdir / "nginx.out", "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        wait_http(f"http://127.0.0.1:{self.port}/nginx-health")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write(self, upstreams):
        conf = render_nginx_conf(self.spec, upstreams, listen=f"127.0.0.1:{self.port}", backups=self.backups,
                                 script_dir=str(self.dir))
        (self.dir / "nginx.conf").write_text(conf)
        (self.dir / SCRIPT_KEY).write_text(prefix_route_script())

    def command(self, *extra):
        return ["nginx", "-p", str(self.dir), "-e", "stderr", "-c", str(self.dir / "nginx.conf"), *extra]

    def reload(self, upstreams):
        """What endpoint removal does to the cluster config (the headless Service stops resolving to the pod)."""
        self.write(upstreams)
        subprocess.run(self.command("-t"), check=True, capture_output=True)
        subprocess.run(self.command("-s", "reload"), check=True, capture_output=True)
        time.sleep(1.0)  # new workers up; old ones keep serving their in-flight streams until done

    def stop(self):
        self.proc.terminate()
        self.proc.wait(20)


class Prometheus:
    """Scrapes `targets` ((host:port, labels, metrics path)) every second."""

    def __init__(self, workdir: Path, targets: list[tuple[str, dict, str]]):
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": f"target-{i}", "metrics_path": path,
                                "static_configs": [{"targets": [address], "labels": labels}]}
                               for i, (address, labels, path) in enumerate(targets)],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=open(workdir / "prometheus.log", "w"),
            stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(self.url + "/-/ready", timeout=60)

    def query(self, promql: str) -> float | None:
        r = httpx.get(self.url + "/api/v1/query", params={"query": promql}).json()
        assert r["status"] == "success", r
        result = r["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def stop(self):
        self.proc.terminate()
        self.proc.wait(20)
