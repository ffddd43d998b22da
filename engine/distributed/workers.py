"""Worker processes for tensor and pipeline parallelism: the engine's process is rank 0 and spawns this node's other
ranks, one per device; a headless node (--headless) spawns all of its own. Every rank meets at one TCP rendezvous:
a free loopback port on one node, --master-addr:--master-port across nodes. A watchdog notices a local worker that
dies, so the engine can say so (naming the rank) instead of hanging in a collective.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagekube.engine.distributed.pipeline_parallel import PPStage
from pagekube.engine.distributed.tensor_parallel import TPShard
from pagekube.engine.errors import WorkerDied

log = logging.getLogger("pagekube.engine")

# A peer that stops answering mid-step fails the step after this long.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("PAGEKUBE_COLLECTIVE_TIMEOUT_S", "60")))
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker waits for the next step packet for as long as it takes
# Pods of a multi-node engine start minutes apart (image pulls, downloads): the leader waits this long for them.
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("PAGEKUBE_RENDEZVOUS_TIMEOUT_S", "1800")))


def ranks_per_node(config) -> int:
    return config.tensor_parallel_size * config.pipeline_parallel_size // config.nnodes


def join(rank: int, config, rendezvous: tuple[str, int],
         device: torch.device) -> tuple[TPShard, PPStage, dist.ProcessGroup]:
    """Join the process group as `rank`: this rank's tensor shard, its pipeline stage (with its stage's TP group),
    and the gloo group of all ranks that carries the step packets (with no timeout: an idle engine sends none)."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_per_node(config)))  # the ranks share the cores
    else:
        torch.cuda.set_device(device)
    host, port = rendezvous  # rank 0 listens there, the others connect (retrying until it is up)
    store = dist.TCPStore(host, port, tp * pp, is_master=rank == 0, timeout=RENDEZVOUS_TIMEOUT)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=tp * pp,
                            timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    # Every rank creates every stage's group, in the same order (torch.distributed requires it).
    stage_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) if pp > 1 and tp > 1 else None
                    for s in range(pp)]
    stage, tp_rank = divmod(rank, tp)
    return TPShard(tp_rank, tp, stage_groups[stage]), PPStage(stage, pp, tp, tp_rank), control


def describe(rank: int, config) -> str:
    if config.pipeline_parallel_size == 1:
        return f"tensor-parallel worker rank {rank}"
    return f"worker rank {rank} (pipeline stage {rank // config.tensor_parallel_size})"


def worker_main(rank: int, config, model_dir, rendezvous: tuple[str, int]) -> None:
    from transformers import AutoConfig

    from pagekube.engine.logging_setup import setup_logging
    from pagekube.engine.model.model_runner import ModelRunner, resolve_device

    setup_logging()
    device_index = rank % ranks_per_node(config)
    shard, stage, control = join(rank, config, rendezvous, resolve_device(config.device, device_index))
    runner = ModelRunner(config, model_dir, AutoConfig.from_pretrained(model_dir), shard=shard, control=control,
                         quantization=config.quantization, stage=stage, device_index=device_index)
    if config.enable_lora:  # slots as rank 0's; it says what to load into them (ModelRunner._send_lora_load)
        runner.enable_lora(config.max_loras, config.max_lora_rank)
    runner.serve_forever()
    dist.destroy_process_group()


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """This node's ranks other than the engine's own, started before it joins (the rendezvous waits for all)."""

    def __init__(self, config, model_dir):
        self.config = config
        if config.nnodes == 1:
            self.rendezvous = ("127.0.0.1", free_loopback_port())
        else:
            self.rendezvous = (config.master_addr, config.master_port)
        per_node = ranks_per_node(config)
        first = config.node_rank * per_node
        self.ranks = [r for r in range(first, first + per_node) if r != 0]  # rank 0 is the engine's process
        ctx = mp.get_context("spawn")  # no fork: the parent's threads and torch state stay out of the workers
        self.procs = [ctx.Process(target=worker_main, args=(r, config, model_dir, self.rendezvous), daemon=True,
                                  name=f"pagekube-rank{r}") for r in self.ranks]
        for p in self.procs:
            p.start()
        self.failure: str | None = None
        self.on_failure = None  # called with the reason, on the watchdog's thread (the server fails streams now)
        self._stopping = threading.Event()
        threading.Thread(target=self._watch, name="rank-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            self.poll()

    def poll(self) -> str | None:
        """The first worker death seen (logged and reported once), or None while all live."""
        for rank, p in zip(self.ranks, self.procs, strict=True):
            if p.exitcode is not None and self.failure is None:
                self.failure = f"{describe(rank, self.config)} died (exit code {p.exitcode})"
                log.error("%s: the engine cannot run without it", self.failure)
                if self.on_failure is not None:
                    self.on_failure(self.failure)
        return self.failure

    def check(self) -> None:
        if self.poll():
            raise WorkerDied(self.failure)

    def wait(self) -> int:
        """A headless node: wait until the leader stops its ranks (0), or until one fails (1; the others are
        ended: without it the group cannot step)."""
        self._stopping.set()  # no watchdog callbacks here: this loop is the watchdog
        while any(p.is_alive() for p in self.procs):
            failed = [(r, p.exitcode) for r, p in zip(self.ranks, self.procs, strict=True) if p.exitcode]
            if failed:
                log.error("%s died (exit code %s): ending this node's ranks", describe(failed[0][0], self.config),
                          failed[0][1])
                self.kill()
                return 1
            time.sleep(0.2)
        return 1 if any(p.exitcode for p in self.procs) else 0

    def stop(self, runner) -> None:
        """Tell the workers to return, then wait for them (or end them)."""
        self._stopping.set()
        if self.poll() is None and runner is not None:
            try:
                runner.stop_workers()
            except RuntimeError as e:  # a collective with a dead peer
                log.warning("stopping the worker ranks: %s", e)
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
