"""ModelRunner: owns the weights and the KV pool; turns a scheduled batch into one forward and its logits."""

from __future__ import annotations

import logging

import torch

from pagekube.engine.attention import make_backend
from pagekube.engine.config import EngineConfig
from pagekube.engine.model import AttentionMetadata
from pagekube.engine.model_loader import load_model
from pagekube.engine.scheduler import ScheduledBatch

log = logging.getLogger("pagekube.engine")

DEFAULT_CPU_KV_BYTES = 512 * 1024**2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir, hf_config):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.backend = make_backend(config.attention_backend, self.device, self.block_size, self.dtype)
        self.model = load_model(hf_config, model_dir, self.dtype, self.device)
        attn = self.model.model.layers[0].self_attn
        self.num_layers = len(self.model.model.layers)
        self.kv_shape = (self.block_size, attn.num_kv_heads, attn.head_dim)
        self.num_blocks = self._num_kv_blocks()
        shape = (self.num_blocks, *self.kv_shape)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.num_layers)
        ]

    @property
    def bytes_per_block(self) -> int:
        bs, heads, dim = self.kv_shape
        return 2 * self.num_layers * bs * heads * dim * torch.finfo(self.dtype).bits // 8

    def _num_kv_blocks(self) -> int:
        budget = self.config.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            budget = self._profile_free_gpu_memory()
        if budget is None:
            budget = DEFAULT_CPU_KV_BYTES
        num = budget // self.bytes_per_block
        if num < 1:
            raise ValueError(f"KV-cache memory {budget} B holds no block of {self.bytes_per_block} B")
        return int(num)

    @torch.inference_mode()
    def _profile_free_gpu_memory(self) -> int:
        """Run the largest step once with no cache; what the GPU has left (times utilization) goes to the pool."""
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.config.max_num_batched_tokens
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = self.model.model.embed_tokens(ids)
        for layer in self.model.model.layers:  # MLP dominates activation memory; attention is paged
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        self.model.compute_logits(hidden[-self.config.max_num_seqs :])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(total * self.config.gpu_memory_utilization - peak)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Forward the batch. Returns logits for the sequences whose step ends at their last token (they sample
        next), and the indices of those sequences in the batch."""
        self.copy_blocks(batch.blocks_to_copy)
        bs = self.block_size
        tokens, positions, slots, starts, ctx_lens, last_rows, sample_idx = [], [], [], [0], [], [], []
        max_blocks = 1
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            tokens.extend(seq.token_ids[start : start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in pos)
            starts.append(starts[-1] + n)
            ctx_lens.append(start + n)
            max_blocks = max(max_blocks, len(seq.block_table))
            if start + n == seq.num_tokens:
                last_rows.append(starts[-1] - 1)
                sample_idx.append(i)
        tables = torch.zeros((len(batch.seqs), max_blocks), dtype=torch.int32)
        for i, seq in enumerate(batch.seqs):
            tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        to_dev = self._to_device
        meta = AttentionMetadata(
            slot_mapping=to_dev(torch.tensor(slots, dtype=torch.long)),
            block_tables=to_dev(tables),
            query_start_loc=to_dev(torch.tensor(starts, dtype=torch.int32)),
            context_lens=to_dev(torch.tensor(ctx_lens, dtype=torch.int32)),
            query_lens=list(batch.num_new_tokens),
            context_lens_list=ctx_lens,
        )
        hidden = self.model(to_dev(torch.tensor(tokens)), to_dev(torch.tensor(positions)),
                            self.kv_caches, meta, self.backend)
        logits = self.model.compute_logits(hidden[to_dev(torch.tensor(last_rows, dtype=torch.long))])
        return logits, sample_idx

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host tensor to the model's device: from pinned memory without blocking on a GPU (the copy overlaps the
        host work that follows; stream order keeps it before the kernels that read it); as is on the CPU."""
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)
