"""ModelRunner: owns the weights and the KV pool; turns a scheduled batch into one forward and its logits.

With tensor and pipeline parallelism every rank has one, holding its shard of its stage's layers and their KV pool.
Rank 0's builds each step's inputs and broadcasts them to every rank as one packed int64 tensor (a header, then the
payload); the workers' runners wait in `serve_forever` and run the same step on their part of the model.
"""

from __future__ import annotations

import json
import logging

import torch
import torch.distributed as dist

from pagekube.engine.config import EngineConfig
from pagekube.engine.core.scheduler import ScheduledBatch
from pagekube.engine.distributed import pipeline_parallel as pp
from pagekube.engine.distributed.pipeline_parallel import PPStage
from pagekube.engine.distributed.tensor_parallel import TPShard
from pagekube.engine.lora.adapter import read_adapter
from pagekube.engine.lora.request import LoRARequest
from pagekube.engine.lora.slots import LoRASlots, LoRAStep
from pagekube.engine.model.attention import make_backend
from pagekube.engine.model.cuda_graphs import CudaGraph, DecodeGraphs
from pagekube.engine.model.model import AttentionMetadata, use_kernels
from pagekube.engine.model.model_loader import load_model
from pagekube.kernels.cpu_ops import CpuKernels, cpu_supports_bf16_dot, load_cpu_kernels, load_int_kernels

FORWARD, STOP, PING, LORA_LOAD = 1, 2, 3, 4  # packet commands, rank 0 -> workers
HEADER = 6  # command, items, tokens, max blocks, logit rows, block copies (LORA_LOAD: command, slot, id, bytes)

log = logging.getLogger("pagekube.engine")

DEFAULT_CPU_KV_BYTES = 512 * 1024**2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name, rank) if name == "cuda" else torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on GPUs and on CPUs with native bf16 dot products (AVX512_BF16, as vLLM's CPU backend
    chooses), float32 on other CPUs, where bf16 arithmetic is emulated and slower."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_supports_bf16_dot() else torch.float32
    return DTYPES[name]


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens (the model's shapes, from its config alone)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return 2 * hf_config.num_hidden_layers * block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir, hf_config, num_blocks: int | None = None,
                 shared_bytes_per_block: int = 0, shard: TPShard = TPShard(), control=None,
                 quantization: str | None = None, stage: PPStage = PPStage(), device_index: int = 0):
        """`num_blocks`: a pool of that many blocks; 0 for none yet (a draft model loads its weights before the
        target sizes its pool, then gets as many blocks as the target: `allocate_kv_pool`). None: sized from
        the memory budget, where `shared_bytes_per_block` is what each block also costs elsewhere (the draft's
        pool). `shard`, `stage` and `control` (a gloo group of all ranks for the step packets): this rank's part
        under tensor and pipeline parallelism; `device_index`: its GPU on this node. `quantization`:
        --quantization, for the served model (a draft model's config.json says its own; without the flag the
        checkpoint's is used)."""
        self.config = config
        self.shard, self.stage, self.control = shard, stage, control
        self.world_size = shard.size * stage.size
        self.device = resolve_device(config.device, device_index)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.backend = make_backend(config.attention_backend, self.device, self.block_size, self.dtype)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            load_cpu_kernels()  # built once per machine; torch's ops where it cannot be
        self.model = load_model(hf_config, model_dir, self.dtype, self.device, shard, quantization, stage)
        if self.device.type == "cpu" and any(getattr(m, "quant", None) for m in self.model.modules()):
            load_int_kernels()  # the int4/int8 Linears' kernel (AVX2), built once per machine
        attn = self.model.model.local_layers[0].self_attn
        # Which CPU kernels run is decided here, once per model; layers then check only their row counts.
        self.kernels = CpuKernels.for_model(self.device, self.dtype, attn.head_dim)
        use_kernels(self.model, self.kernels)
        self.backend.kernels = self.kernels
        if self.device.type == "cpu":
            log.info({"msg": "CPU kernels", "model": str(model_dir), "kernels": self.kernels.names or ["torch"]})
        self.lora = None  # LoRASlots once enable_lora is called
        self.graphs: DecodeGraphs | None = None  # once capture_cuda_graphs is called
        self.num_layers = len(self.model.model.local_layers)
        self.kv_shape = (self.block_size, attn.num_kv_heads, attn.head_dim)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        if num_blocks == 0:
            return
        num_blocks = num_blocks or self._num_kv_blocks(shared_bytes_per_block)
        if self.world_size > 1:  # every rank's pool must hold the same blocks: the smallest one's
            agreed = torch.tensor([num_blocks])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=control)
            num_blocks = int(agreed)
        self.allocate_kv_pool(num_blocks)

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        self.lora = LoRASlots(self.model, max_loras, max_rank)
        self.max_lora_rank = max_rank

    def _send_lora_load(self, slot: int, adapter) -> None:
        """Tell every rank to load `adapter` into `slot`: each reads the adapter from its path and keeps its own
        slice (engine/lora/adapter.py), as each rank reads its slice of the model from the model's path."""
        if self.world_size == 1:
            return
        r = adapter.request
        spec = json.dumps([r.lora_name, r.lora_int_id, r.lora_path, r.base_model_name]).encode()
        dist.broadcast(torch.tensor([LORA_LOAD, slot, r.lora_int_id, len(spec), 0, 0]), src=0, group=self.control)
        dist.broadcast(torch.tensor(list(spec), dtype=torch.long), src=0, group=self.control)

    def _load_lora(self, header: list[int]) -> None:
        """A worker: load what rank 0 loaded into the same slot (a failure ends the rank, and so the engine: rank 0
        read the same path a moment ago)."""
        spec = torch.empty(header[3], dtype=torch.long)
        dist.broadcast(spec, src=0, group=self.control)
        name, lora_id, path, base = json.loads(bytes(spec.tolist()).decode())
        adapter = read_adapter(LoRARequest(name, lora_id, path, base), self.model, self.max_lora_rank, self.dtype)
        self.lora.load(header[1], adapter)

    def kernel_report(self) -> dict[str, str]:
        """Which kernels this model runs (logged at start, on /version and as pagekube:kernels_info)."""
        return {"device": self.device.type, "dtype": str(self.dtype).removeprefix("torch."),
                "attention": self.backend.name, "cpu_kernels": ",".join(self.kernels.names) or "none"}

    @torch.inference_mode()
    def capture_cuda_graphs(self, sizes: list[int], max_model_len: int, graph_type=CudaGraph) -> None:
        """Decode steps of up to max(sizes) sequences replay CUDA graphs from now on (engine/model/cuda_graphs.py);
        called once the KV pool is allocated (a graph keeps its address)."""
        self.graphs = DecodeGraphs(lambda ids, pos, meta: self.model(ids, pos, self.kv_caches, meta, self.backend),
                                   sizes, -(-max_model_len // self.block_size), self.device, graph_type)

    def allocate_kv_pool(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        shape = (num_blocks, *self.kv_shape)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.num_layers)
        ]

    @property
    def bytes_per_block(self) -> int:
        bs, heads, dim = self.kv_shape  # this rank's KV heads
        return 2 * self.num_layers * bs * heads * dim * torch.finfo(self.dtype).bits // 8

    def _num_kv_blocks(self, shared_bytes_per_block: int) -> int:
        budget = self.config.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            budget = self._profile_free_gpu_memory()
        if budget is None:
            budget = DEFAULT_CPU_KV_BYTES
        per_block = self.bytes_per_block + shared_bytes_per_block
        num = budget // per_block
        if num < 1:
            raise ValueError(f"KV-cache memory {budget} B holds no block of {per_block} B")
        return int(num)

    @torch.inference_mode()
    def _profile_free_gpu_memory(self) -> int:
        """Run the largest step once with no cache; what the GPU has left (times utilization) goes to the pool."""
        torch.cuda.reset_peak_memory_stats(self.device)
        n, decoder = self.config.max_num_batched_tokens, self.model.model
        if self.stage.is_first:
            hidden = decoder.embed_tokens(torch.zeros(n, dtype=torch.long, device=self.device))
        else:
            hidden = torch.zeros(n, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
        for layer in decoder.local_layers:  # MLP dominates activation memory; attention is paged
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        if self.stage.is_last:
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
        self._copy_blocks(src, dst)

    def _copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]

    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int], list[int]]:
        """Forward the batch. Returns logits for the sequences whose step ends at their last token (they sample
        next), the indices of those sequences in the batch, and each one's first logits row. A sequence with
        draft tokens gets a row per draft plus one (the target's verdict on each, then the bonus token)."""
        items, sample_idx, first_rows, rows = [], [], [], 0
        slot_of = {}
        if self.lora is not None:
            slot_of = self.lora.assign({s.request.lora.id: s.request.lora for s in batch.seqs if s.request.lora},
                                       self._send_lora_load)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start, drafts = seq.num_computed_tokens, seq.spec_tokens
            real = n - len(drafts)
            ends = start + real == seq.num_tokens
            num_logits = (1 + len(drafts)) if ends else 0
            prompt_rows = min(n, max(0, seq.num_prompt_tokens - start))
            items.append((seq.block_table, start, seq.token_ids[start : start + real] + drafts, num_logits, prompt_rows,
                          slot_of.get(seq.lora_id, -1)))
            if ends:
                sample_idx.append(i)
                first_rows.append(rows)
                rows += num_logits
        return self.forward(items, batch.blocks_to_copy), sample_idx, first_rows

    def forward(self, items: list[tuple], copies: list[tuple[int, int]] = ()) -> torch.Tensor:
        """One forward over (block_table, start position, tokens, logits wanted[, prompt rows[, LoRA slot]]) items:
        each item's tokens take positions start.. and their KV slots in its blocks; logits come back for each item's
        last `logits wanted` tokens, in item order; the first `prompt rows` tokens are prompt (the rest generated;
        without it, one token is a decode and more are prompt); the adapter slot its rows use (-1 or none: the base
        model). Block copies (copy-on-write) are applied first."""
        bs = self.block_size
        tokens, positions, slots, starts, ctx_lens, logit_rows, prompt_rows = [], [], [], [0], [], [], []
        lora_slots = []
        max_blocks = max([1] + [len(table) for table, *_ in items])
        tables = []
        for table, start, toks, num_logits, *extra in items:
            n = len(toks)
            tokens.extend(toks)
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            starts.append(starts[-1] + n)
            ctx_lens.append(start + n)
            tables.extend(table)
            tables.extend([0] * (max_blocks - len(table)))
            logit_rows.extend(range(starts[-1] - num_logits, starts[-1]))
            prompt_rows.append(extra[0] if extra else (0 if n == 1 else n))
            lora_slots.append(extra[1] if len(extra) > 1 else -1)
        header = [FORWARD, len(items), len(tokens), max_blocks, len(logit_rows), len(copies)]
        payload = torch.tensor([*tokens, *positions, *slots, *starts, *ctx_lens, *tables, *logit_rows,
                                *(s for s, _ in copies), *(d for _, d in copies), *prompt_rows, *lora_slots],
                               dtype=torch.long)
        if self.world_size > 1:
            dist.broadcast(torch.tensor(header), src=0, group=self.control)
            dist.broadcast(payload, src=0, group=self.control)
        return self._run(header, payload)

    def serve_forever(self) -> None:
        """A worker rank: run every step rank 0 broadcasts, until it says stop."""
        while True:
            header = torch.empty(HEADER, dtype=torch.long)
            dist.broadcast(header, src=0, group=self.control)
            header = header.tolist()
            if header[0] == STOP:
                return
            if header[0] == PING:
                continue
            if header[0] == LORA_LOAD:
                self._load_lora(header)
                continue
            _, items, tokens, max_blocks, logits, copies = header
            payload = torch.empty(3 * tokens + 4 * items + 1 + items * max_blocks + logits + 2 * copies,
                                  dtype=torch.long)
            dist.broadcast(payload, src=0, group=self.control)
            self._run(header, payload)

    def ping_workers(self) -> None:
        """An empty packet: raises if a rank is gone (the idle leader's check that every rank still answers)."""
        if self.world_size > 1:
            dist.broadcast(torch.tensor([PING] + [0] * (HEADER - 1)), src=0, group=self.control)

    def stop_workers(self) -> None:
        if self.world_size > 1:  # (called on rank 0)
            dist.broadcast(torch.tensor([STOP] + [0] * (HEADER - 1)), src=0, group=self.control)

    @torch.inference_mode()
    def _run(self, header: list[int], payload: torch.Tensor) -> torch.Tensor | None:
        _, n_items, n_tokens, max_blocks, n_logits, n_copies = header
        tokens, positions, slots, starts, ctx_lens, tables, logit_rows, src, dst, prompt_rows, lora_slots = (
            payload.split([n_tokens, n_tokens, n_tokens, n_items + 1, n_items, n_items * max_blocks, n_logits, n_copies,
                           n_copies, n_items, n_items]))
        to_dev = self._to_device
        if n_copies:
            self._copy_blocks(to_dev(src), to_dev(dst))
        if self.graphs is not None and n_tokens == n_items and not prompt_rows.any():  # a decode step
            hidden = self.graphs.run(tokens, positions, slots, tables.view(n_items, max_blocks).to(torch.int32),
                                     ctx_lens)
            if hidden is not None:
                return self.model.compute_logits(hidden[to_dev(logit_rows)])
        starts_list, ctx_list = starts.tolist(), ctx_lens.tolist()
        meta = AttentionMetadata(
            slot_mapping=to_dev(slots),
            block_tables=to_dev(tables.view(n_items, max_blocks).to(torch.int32)),
            query_start_loc=to_dev(starts.to(torch.int32)),
            context_lens=to_dev(ctx_lens.to(torch.int32)),
            query_lens=[b - a for a, b in zip(starts_list, starts_list[1:])],
            context_lens_list=ctx_list,
            prompt_rows=prompt_rows.tolist(),
        )
        if self.lora is not None:  # this step's rows per adapter slot, for every LoRA Linear
            self.lora.step = LoRAStep.of(starts_list, lora_slots.tolist(), self.device)
        stage = self.stage
        received = None
        if not stage.is_first:
            received = pp.recv_activations(n_tokens, self.model.config.hidden_size, self.dtype, self.device, stage)
        try:
            out = self.model(to_dev(tokens), to_dev(positions), self.kv_caches, meta, self.backend, received)
        finally:
            if self.lora is not None:
                self.lora.step = LoRAStep()
        vocab = self.model.config.vocab_size
        if not stage.is_last:  # hand on; rank 0 then waits for the last stage's logits
            pp.send_activations(*out, stage)
            if not stage.is_first or self.shard.rank:
                return None
            if not n_logits:
                return torch.empty(0, vocab, device=self.device)
            return pp.recv_logits(n_logits, vocab, self.device, stage)
        logits = self.model.compute_logits(out[to_dev(logit_rows)])
        if stage.size > 1 and self.shard.rank == 0 and n_logits:
            pp.send_logits(logits)
        return logits

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host tensor to the model's device: from pinned memory without blocking on a GPU (the copy overlaps the
        host work that follows; stream order keeps it before the kernels that read it); as is on the CPU."""
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)
