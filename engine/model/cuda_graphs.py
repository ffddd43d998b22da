"""Decode steps replayed as CUDA graphs, as vLLM does: a step of one token per sequence launches every layer's
kernels from the host, and at small batches that launch time is most of the step. At start, after the KV pool
is allocated, one graph per batch size in `capture_sizes` records the model's forward over persistent input
buffers; a decode step then copies its inputs into those buffers (padded up to the next captured size) and
replays the graph. Prefill, mixed and speculative steps, and batches above the largest size, run eagerly.

Padding rows are inert: their slot is -1 (the KV write skips it), their context one token of block 0, and their
output rows are dropped. The block table buffer is as wide as `max_model_len` needs, so a graph never depends on
how long this step's contexts are. What a graph may read is only these buffers and the KV pool: the Triton
backend's decode path reads nothing else (the torch backend plans steps on the host, so it runs eagerly).
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable

import torch

from pagekube.engine.model.model import AttentionMetadata

log = logging.getLogger("pagekube.engine")

BATCH_ALIGNMENT = 8  # vLLM's: sizes above 4 are multiples of 8


def capture_sizes(cuda_graph_sizes: list[int] | None, max_num_seqs: int) -> list[int]:
    """vLLM's `--cuda-graph-sizes`: none, 1, 2, 4, then every 8 up to --max-num-seqs; one value N, the same up to N;
    several, exactly those. Never above --max-num-seqs (no decode step has more rows)."""
    if cuda_graph_sizes and len(cuda_graph_sizes) > 1:
        sizes = set(cuda_graph_sizes)
    else:
        top = cuda_graph_sizes[0] if cuda_graph_sizes else max_num_seqs
        sizes = {s for s in (1, 2, 4) if s <= top} | set(range(BATCH_ALIGNMENT, top + 1, BATCH_ALIGNMENT))
    return sorted(s for s in sizes if s <= max_num_seqs)


def eager_reason(config, device: torch.device, backend: str, world_size: int, lora: bool) -> str | None:
    """Why this engine's decode steps run eagerly; None where they replay CUDA graphs."""
    if device.type != "cuda":
        return "not on a CUDA device"
    if config.enforce_eager:
        return "--enforce-eager"
    if backend != "triton":
        return f"the {backend} attention backend plans each step on the host"
    if world_size > 1:
        return "tensor or pipeline parallelism (not captured yet)"
    if lora:
        return "--enable-lora (a step's adapter rows are grouped on the host)"
    return None


class CudaGraph:
    """torch.cuda.CUDAGraph: warmed up once (Triton compiles its kernels), then captured into a memory pool that
    every size shares (captured largest first, as vLLM does, so the smaller ones reuse its memory)."""

    def __init__(self, pool):
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    @classmethod
    def new_pool(cls):
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class StandInGraph:
    """What the CPU tests capture with: the same contract as a CUDA graph (the function reads only the persistent
    buffers; its output lands in the tensor capture returned), kept by calling the function again on replay. A
    forward that read anything but the buffers would replay stale inputs here as on a GPU."""

    def __init__(self, pool):
        self.fn = self.out = None

    @classmethod
    def new_pool(cls):
        return None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())


class DecodeGraphs:
    """One captured forward per size over shared persistent buffers. `forward(input_ids, positions, meta)` is the
    model's forward over the KV pool, returning hidden states [rows, hidden]."""

    def __init__(self, forward: Callable, sizes: list[int], max_blocks: int, device: torch.device,
                 graph_type=CudaGraph):
        self.sizes = sizes
        top = sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(top, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple] = {}
        self.replays = 0
        start = time.monotonic()
        memory = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        pool = graph_type.new_pool()
        for size in reversed(sizes):
            meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
                                     query_start_loc=self.query_start_loc[:size + 1],
                                     context_lens=self.context_lens[:size], query_lens=[1] * size,
                                     context_lens_list=[1] * size, prompt_rows=[0] * size)
            graph = graph_type(pool)
            out = graph.capture(lambda size=size, meta=meta: forward(self.input_ids[:size], self.positions[:size],
                                                                     meta))
            self.graphs[size] = graph, out
        memory = (torch.cuda.memory_allocated(device) - memory) if device.type == "cuda" else 0
        log.info({"msg": "CUDA graphs captured", "sizes": sizes, "seconds": round(time.monotonic() - start, 2),
                  "memory_mb": round(memory / 1e6, 1)})

    def padded_size(self, rows: int) -> int | None:
        """The captured size a step of `rows` decodes replays (the smallest that holds it); None: run eagerly."""
        i = bisect_left(self.sizes, rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor | None:
        """One decode step (a row per sequence): its hidden states [rows, hidden], or None where no graph holds it
        (its block table wider than the buffers' included)."""
        rows, width = block_tables.shape
        size = self.padded_size(rows)
        if size is None or width > self.block_tables.shape[1]:
            return None
        for buf, values, pad in ((self.input_ids, input_ids, 0), (self.positions, positions, 0),
                                 (self.slot_mapping, slot_mapping, -1), (self.context_lens, context_lens, 1)):
            buf[:rows].copy_(values, non_blocking=True)
            buf[rows:size].fill_(pad)
        self.block_tables[:rows, :width].copy_(block_tables, non_blocking=True)
        self.block_tables[:size, width:].zero_()
        self.block_tables[rows:size].zero_()
        graph, out = self.graphs[size]
        graph.replay()
        self.replays += 1
        return out[:rows]
