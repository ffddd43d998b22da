"""Tensor-parallel worker processes: rank 0 (the engine's own process) spawns ranks 1..N-1, one per device, and
they meet over a loopback TCP rendezvous. A watchdog notices a worker that dies, so the engine can say so (naming
the rank) instead of hanging in a collective.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagekube.engine.errors import WorkerDied

log = logging.getLogger("pagekube.engine")

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)  # a peer that stops answering fails the step, not the process


def init_distributed(rank: int, size: int, port: int, device: torch.device):
    """Join the process group; returns the gloo group that carries step packets (NCCL groups want GPU tensors)."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # N processes share the cores
    else:
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo") if backend == "nccl" else None


def worker_main(rank: int, size: int, port: int, config, model_dir) -> None:
    from transformers import AutoConfig

    from pagekube.engine.distributed.tensor_parallel import TPShard
    from pagekube.engine.logging_setup import setup_logging
    from pagekube.engine.model.model_runner import ModelRunner, resolve_device

    setup_logging()
    control = init_distributed(rank, size, port, resolve_device(config.device, rank))
    runner = ModelRunner(config, model_dir, AutoConfig.from_pretrained(model_dir), shard=TPShard(rank, size),
                         control=control, quantization=config.quantization)
    runner.serve_forever()
    dist.destroy_process_group()


class Workers:
    """Ranks 1..size-1, started before rank 0 joins the group (the rendezvous waits for everyone)."""

    def __init__(self, size: int, config, model_dir):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        ctx = mp.get_context("spawn")  # no fork: the parent's threads and torch state stay out of the workers
        self.procs = [ctx.Process(target=worker_main, args=(r, size, self.port, config, model_dir), daemon=True,
                                  name=f"pagekube-tp-rank{r}") for r in range(1, size)]
        for p in self.procs:
            p.start()
        self.failure: str | None = None
        self.on_failure = None  # called with the reason, on the watchdog's thread (the server fails streams now)
        self._stopping = threading.Event()
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            self.poll()

    def poll(self) -> str | None:
        """The first worker death seen (logged and reported once), or None while all live."""
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None and self.failure is None:
                self.failure = f"tensor-parallel worker rank {rank} died (exit code {p.exitcode})"
                log.error("%s: the engine cannot run without it", self.failure)
                if self.on_failure is not None:
                    self.on_failure(self.failure)
        return self.failure

    def check(self) -> None:
        if self.poll():
            raise WorkerDied(self.failure)

    def stop(self, runner) -> None:
        """Tell the workers to return, then wait for them (or end them)."""
        self._stopping.set()
        if self.poll() is None and runner is not None:
            try:
                runner.stop_workers()
            except RuntimeError as e:  # a collective with a dead peer
                log.warning("stopping tensor-parallel workers: %s", e)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()

    def kill(self) -> None:
        """End the workers without a word: for when the thread that talks to them is stuck in a collective."""
        self._stopping.set()
        for p in self.procs:
            p.kill()
