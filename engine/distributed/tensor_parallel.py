"""Tensor parallelism (Megatron-style) on torch.distributed: which slice of the model a rank holds, and the
collectives its forward needs.

q/k/v and gate/up are split by output rows (column-parallel), o_proj and down_proj by input columns (row-parallel,
one all-reduce each), the embedding and LM head by vocabulary rows (the embedding all-reduces, the logits are
gathered on rank 0 only). KV heads are split across ranks; with more ranks than KV heads each KV head is
replicated on size / num_kv_heads ranks, as vLLM does. NCCL on GPUs, gloo on CPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPShard:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = field(default=None, compare=False)  # this stage's ranks; None: all of them

    def split(self, n: int) -> tuple[int, int]:
        """(this rank's share of n, where it starts) for an evenly divisible dimension."""
        share = n // self.size
        return share, self.rank * share

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(KV heads held here, the first one): a split, or one replicated head when there are more ranks."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        return 1, self.rank // (self.size // num_kv_heads)

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(rows per rank, padded so every rank has as many; first row here; rows here that are real)."""
        per_rank = -(-vocab_size // self.size)
        start = self.rank * per_rank
        return per_rank, start, max(0, min(vocab_size, start + per_rank) - start)


def unsupported(hf_config, size: int) -> str | None:
    """Why the model cannot be split over `size` ranks, or None."""
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % size:
        return f"its {heads} attention heads do not divide by tensor_parallel_size {size}"
    if (kv % size) if kv >= size else (size % kv):
        return f"its {kv} KV heads and tensor_parallel_size {size} do not divide one another"
    if hf_config.intermediate_size % size:
        return f"its intermediate_size {hf_config.intermediate_size} does not divide by tensor_parallel_size {size}"
    return None


def all_reduce(x: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """The sum of every rank's x. On the CPU every rank gathers the parts and adds them in rank order in float32,
    then rounds once: gloo's ring cuts the tensor into chunks by its size, so an element's parts would add up in an
    order that depends on how many rows the step has (greedy bf16 output would depend on the batch)."""
    if shard.size == 1:
        return x
    if x.device.type != "cpu":
        dist.all_reduce(x, group=shard.group)
        return x
    parts = [torch.empty_like(x) for _ in range(shard.size)]
    dist.all_gather(parts, x.contiguous(), group=shard.group)
    total = parts[0].float()
    for part in parts[1:]:
        total += part
    return total.to(x.dtype)


def gather_logits(local: torch.Tensor, shard: TPShard, vocab_size: int) -> torch.Tensor | None:
    """Every rank's vocabulary slice of the logits, concatenated on TP rank 0 (None elsewhere)."""
    if shard.size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(shard.size)] if shard.rank == 0 else None
    dist.gather(local.contiguous(), parts, group=shard.group, group_dst=0)
    return torch.cat(parts, dim=-1)[:, :vocab_size] if shard.rank == 0 else None
