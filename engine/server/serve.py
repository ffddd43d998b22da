"""Run the HTTP server: listen at once (/health 503 while the model loads), then drain on SIGTERM.

Drain (DESIGN.md): /health turns 503 at once, new generation requests get 503 + Retry-After, accepted requests
finish or are aborted at --drain-timeout (clients get a final chunk with finish_reason "abort"), then exit 0.
A second SIGTERM or SIGINT exits at once. A dead engine (its loop raised, e.g. a tensor-parallel worker died) makes
/health 503 and the process exit 1 a moment later, so Kubernetes restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import time

import uvicorn

from pagekube.engine.async_engine import AsyncEngine, EngineThread
from pagekube.engine.config import EngineConfig
from pagekube.engine.pooling.async_pooling import AsyncPoolingEngine
from pagekube.engine.quantization.schemes import QuantizationError
from pagekube.engine.server.app import ServerState, create_app
from pagekube.engine.server.metrics import EngineMetrics
from pagekube.engine.server.request_log import RequestLogger

log = logging.getLogger("pagekube.server")


class _Server(uvicorn.Server):
    def capture_signals(self):  # signals are ours: uvicorn's handler would stop at once, without draining
        return contextlib.nullcontext()


def run_server(config: EngineConfig) -> int:
    return asyncio.run(_serve(config))


async def _serve(config: EngineConfig) -> int:
    state = ServerState(config)
    # Keep-alive outlives the load balancer's (nginx upstream keepalive_timeout 60s): the proxy closes idle
    # connections first, so it never sends a request on one the engine is closing (a 502 it may not retry).
    server = _Server(uvicorn.Config(create_app(state), host=config.host, port=config.port, log_config=None,
                                    access_log=False, lifespan="off", timeout_graceful_shutdown=10,
                                    timeout_keep_alive=75))
    loop = asyncio.get_running_loop()
    signals_seen = 0
    drain_task: asyncio.Task | None = None

    def on_signal(signum: int) -> None:
        nonlocal signals_seen, drain_task
        signals_seen += 1
        if signals_seen > 1 or state.engine is None:
            log.warning("signal %s: exiting now", signal.Signals(signum).name)
            os._exit(0 if state.engine is None else 1)
        log.info("signal %s: draining (timeout %.0f s)", signal.Signals(signum).name, config.drain_timeout)
        drain_task = asyncio.ensure_future(drain(state, server))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    serving = asyncio.ensure_future(server.serve())
    while not server.started and not serving.done():  # listen first: /health answers 503 "loading" from here
        await asyncio.sleep(0.01)
    try:
        engine_thread = EngineThread()  # imports torch and loads the model, then steps it; the loop stays free
        engine = await asyncio.wrap_future(engine_thread.submit(load_engine, config))
    except Exception as err:
        if isinstance(err, QuantizationError):  # the checkpoint's scheme, refused: the message says it all
            log.error({"msg": "model load failed", "error": str(err)})
        else:
            log.exception("model load failed")
        server.should_exit = True
        await serving
        return 1
    # What loading made (torch, transformers, the model) lives as long as the process: out of the collector's
    # sight, or each full collection walks ~400k objects inside a step (3.5 ms a step at batch 1; as vLLM does).
    gc.collect()
    gc.freeze()
    pooling = engine.runner_type == "pooling"
    state.metrics = EngineMetrics(engine.served_model_name, max_model_len=engine.max_model_len,
                                  cache_config=None if pooling else engine.cache_config(),
                                  spec_stats=None if pooling else engine.spec_stats,
                                  max_loras=config.max_loras if config.enable_lora else None)
    engine.stat_listeners.append(state.metrics)
    state.kernels = engine.kernel_report()
    state.metrics.kernels_info(state.kernels)
    if not config.disable_log_requests:
        engine.stat_listeners.append(RequestLogger(engine.served_model_name, config.enable_log_prompts))
    state.engine = (AsyncPoolingEngine if pooling else AsyncEngine)(engine, engine_thread)
    log.info("ready: serving %s on http://%s:%d (kernels: %s)", engine.served_model_name, config.host, config.port,
             state.kernels)
    watching = asyncio.ensure_future(exit_when_dead(state, server))
    await serving
    watching.cancel()
    if drain_task is not None:
        await drain_task
    state.engine.shutdown()
    if state.engine.dead is not None:
        log.error("exiting with status 1: the engine is dead (%s)", state.engine.dead)
        return 1
    log.info("exited cleanly")
    return 0


def load_engine(config: EngineConfig):
    log.info("loading the model")
    from pagekube.engine.runner import load_engine  # torch and transformers: only once the socket listens

    return load_engine(config)


async def exit_when_dead(state: ServerState, server: uvicorn.Server) -> None:
    while state.engine.dead is None:
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)  # open streams get their error event, probes see 503
    server.should_exit = True


async def drain(state: ServerState, server: uvicorn.Server) -> None:
    state.draining = True
    if state.metrics:
        state.metrics.draining.set(1)
    eng = state.engine
    deadline = time.monotonic() + state.config.drain_timeout
    while eng.num_unfinished and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if eng.num_unfinished:
        log.warning("drain timeout: aborting %d unfinished request(s)", eng.num_unfinished)
        eng.abort_all()
        until = time.monotonic() + 5
        while eng.num_unfinished and time.monotonic() < until:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # let handlers write their last chunk before uvicorn closes connections
    log.info("drain complete")
    server.should_exit = True
