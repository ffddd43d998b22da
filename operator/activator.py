"""The activator: NGINX's backup upstream while no engine is up (scaled to zero, or all pods restarting).

It counts every request it holds in `pagekube:activator_requests_pending`, which the ScaledObject's query adds to
the engines' queue depth, so KEDA wakes the Deployment on the first request. It never writes replicas itself (KEDA
is the only writer of 0 -> 1). It holds each request (bounded by --max-pending, then 429; by --hold-timeout, then
503, both with Retry-After) until an engine is ready, then proxies it there, streaming unbuffered.

Engines are found as NGINX finds them: the upstream names (the headless Service, which lists only ready pods) are
resolved every second, and each address counts once its `/health` answers 200 (not loading, not draining). The
same code runs against static addresses outside a cluster. No Kubernetes API access, so no RBAC of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import socket

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger("pagekube.activator")
PROBE_INTERVAL = 1.0
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length"}


def error(status: int, message: str, code: str, retry_after: int) -> web.Response:
    body = {"error": {"message": message, "type": "service_unavailable" if status == 503 else "rate_limit_error",
                      "param": None, "code": code}}
    return web.json_response(body, status=status, headers={"Retry-After": str(retry_after)})


class ReadyEngines:
    """Addresses (host:port) of engines whose /health is 200, refreshed every PROBE_INTERVAL."""

    def __init__(self, upstreams: list[str]):
        self.upstreams = upstreams  # host:port; a host name may resolve to many pods
        self.ready: list[str] = []
        self.changed = asyncio.Event()
        self._rr = itertools.count()

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            ready = []
            for address in await self._resolve():
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    async with session.get(f"http://{address}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            ready.append(address)
            if ready != self.ready:
                log.info("ready engines: %s", ready or "none")
                self.ready = ready
            if ready:
                self.changed.set()
            else:
                self.changed.clear()
            await asyncio.sleep(PROBE_INTERVAL)

    async def _resolve(self) -> list[str]:
        loop, found = asyncio.get_running_loop(), []
        for upstream in self.upstreams:
            host, _, port = upstream.rpartition(":")
            try:
                infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, family=socket.AF_INET)
            except OSError:
                continue  # no ready pod: the headless name has no records
            found += sorted({f"{info[4][0]}:{port}" for info in infos})
        return found

    def pick(self) -> str | None:
        return self.ready[next(self._rr) % len(self.ready)] if self.ready else None


class Activator:
    def __init__(self, llmdeployment: str, upstreams: list[str], max_pending: int, hold_timeout: float):
        self.engines = ReadyEngines(upstreams)
        self.max_pending = max_pending
        self.hold_timeout = hold_timeout
        self.registry = CollectorRegistry()
        self.pending = Gauge("pagekube:activator_requests_pending", "Requests held until an engine is ready",
                             ["llmdeployment"], registry=self.registry).labels(llmdeployment)
        self.outcomes = Counter("pagekube:activator_requests", "Requests the activator finished, by outcome",
                                ["llmdeployment", "outcome"], registry=self.registry)
        for outcome in ("proxied", "overloaded", "timeout", "failed"):
            self.outcomes.labels(llmdeployment, outcome)
        self.llmdeployment = llmdeployment
        self._held = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_get("/activator/metrics", self.metrics)
        app.router.add_get("/activator/healthz", self.healthz)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.cleanup_ctx.append(self._background)
        return app

    async def _background(self, app: web.Application):
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                             auto_decompress=False)
        task = asyncio.create_task(self.engines.run(self.session))
        yield
        task.cancel()
        await self.session.close()

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    def _count(self, outcome: str) -> None:
        self.outcomes.labels(self.llmdeployment, outcome).inc()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.engines.pick() is None:
            if self._held >= self.max_pending:
                self._count("overloaded")
                return error(429, f"the model is starting and {self.max_pending} requests already wait for it",
                             "activator_full", 5)
            self._held += 1
            self.pending.inc()
            try:
                await asyncio.wait_for(self.engines.changed.wait(), self.hold_timeout)
            except asyncio.TimeoutError:
                self._count("timeout")
                return error(503, f"no engine became ready within {self.hold_timeout:g} s", "cold_start_timeout", 10)
            finally:
                self._held -= 1
                self.pending.dec()
        return await self._proxy(request)

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        target = self.engines.pick()
        if target is None:  # it went away again between the wake-up and now
            self._count("failed")
            return error(503, "the engine went away before the request reached it", "engine_unavailable", 5)
        try:
            upstream = await self.session.request(request.method, f"http://{target}{request.path_qs}",
                                                  headers=headers, data=body)
        except (aiohttp.ClientError, OSError) as e:
            self._count("failed")
            return error(503, f"the engine did not answer: {e}", "engine_unavailable", 5)
        async with upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():  # as it comes: SSE chunks are not held back
                await response.write(chunk)
            await response.write_eof()
        self._count("proxied")
        return response


def run_activator(llmdeployment: str, upstreams: list[str], host: str, port: int, max_pending: int,
                  hold_timeout: float) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    activator = Activator(llmdeployment, upstreams, max_pending, hold_timeout)
    log.info(json.dumps({"msg": "activator listening", "port": port, "upstreams": upstreams,
                         "max_pending": max_pending, "hold_timeout": hold_timeout}))
    web.run_app(activator.app(), host=host, port=port, access_log=None, print=None, handle_signals=True)
    return 0
