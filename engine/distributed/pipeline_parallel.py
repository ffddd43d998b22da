"""Pipeline parallelism: the decoder's layers split into stages, one per group of tensor-parallel ranks.

Global rank = stage x TP size + TP rank (vLLM's layout: a stage's TP ranks are neighbours, so with TP = GPUs per node
a stage is a node). Stage 0 embeds, the last stage normalizes and computes the logits; each stage sends the hidden
states and the residual stream to the same TP rank of the next stage (point-to-point: NCCL on GPUs, gloo on CPUs),
and the last stage's TP rank 0 sends the logits to rank 0, which samples. One micro-batch is in flight at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class PPStage:
    rank: int = 0  # this stage
    size: int = 1  # stages
    tp_size: int = 1  # ranks per stage
    tp_rank: int = 0

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, num_layers: int) -> range:
        """This stage's layers. An uneven split gives the extra layers to the stages before the last (which also
        computes the logits), as vLLM's get_pp_indices does."""
        sizes = [num_layers // self.size] * self.size
        for i in range(num_layers % self.size):
            sizes[-2 - i] += 1
        start = sum(sizes[: self.rank])
        return range(start, start + sizes[self.rank])

    def global_rank(self, stage: int, tp_rank: int | None = None) -> int:
        return stage * self.tp_size + (self.tp_rank if tp_rank is None else tp_rank)


def unsupported(num_layers: int, size: int) -> str | None:
    """Why a model with `num_layers` layers cannot run in `size` stages, or None."""
    if num_layers < size:
        return f"its {num_layers} layers are fewer than pipeline_parallel_size {size}"
    return None


def send_activations(hidden: torch.Tensor, residual: torch.Tensor, stage: PPStage) -> None:
    """The hidden states and the residual stream, as one message, to this TP rank of the next stage."""
    dist.send(torch.stack((hidden, residual)).contiguous(), dst=stage.global_rank(stage.rank + 1))


def recv_activations(num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                     stage: PPStage) -> tuple[torch.Tensor, torch.Tensor]:
    buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
    dist.recv(buf, src=stage.global_rank(stage.rank - 1))
    return buf[0], buf[1]


def send_logits(logits: torch.Tensor) -> None:
    """From the last stage's TP rank 0 to rank 0 (the scheduler and the sampler)."""
    dist.send(logits.contiguous(), dst=0)


def recv_logits(rows: int, vocab_size: int, device: torch.device, stage: PPStage) -> torch.Tensor:
    logits = torch.empty(rows, vocab_size, dtype=torch.float32, device=device)
    dist.recv(logits, src=stage.global_rank(stage.size - 1, 0))
    return logits
