"""Counting for the parallelism benchmarks (bench/tp_comm.py, bench/pp_comm.py): torch.distributed calls made in
this process (rank 0) and the engine's steps."""

from __future__ import annotations

import time

import torch.distributed as dist


class Tally:
    """Wraps a torch.distributed call (all_reduce, all_gather, send, ...) in this process: calls, bytes, seconds."""

    def __init__(self, name: str):
        self.name, self.calls, self.bytes, self.seconds = name, 0, 0, 0.0
        self.inner = getattr(dist, name)
        setattr(dist, name, self)

    def __call__(self, tensor, *args, **kwargs):
        start = time.perf_counter()
        out = self.inner(tensor, *args, **kwargs)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        parts = tensor if isinstance(tensor, list) else [tensor]  # all_gather's first argument: the outputs
        self.bytes += sum(t.numel() * t.element_size() for t in parts)
        return out

    def restore(self) -> None:
        setattr(dist, self.name, self.inner)


class StepTimer:
    """Wraps an engine's step: how many ran and their total seconds."""

    def __init__(self, engine):
        self.steps, self.seconds = 0, 0.0
        self.inner = engine.step
        engine.step = self

    def __call__(self):
        start = time.perf_counter()
        out = self.inner()
        self.seconds += time.perf_counter() - start
        self.steps += 1
        return out
