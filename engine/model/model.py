"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Module and parameter names match Hugging Face's, so checkpoints load by name. One forward takes a flattened batch
of mixed prefill and decode tokens; `AttentionMetadata` says where each sequence's tokens sit and go.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pagekube.engine.distributed.pipeline_parallel import PPStage
from pagekube.engine.distributed.tensor_parallel import TPShard, all_reduce, gather_logits
from pagekube.kernels.cpu_ops import NO_KERNELS, CpuKernels


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] int64: where each new token's K/V goes
    block_tables: torch.Tensor  # [seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [seqs + 1] int32
    context_lens: torch.Tensor  # [seqs] int32, tokens in cache after this step
    query_lens: list[int]
    context_lens_list: list[int]
    derived: dict = field(default_factory=dict)  # per-step tensors a backend builds once and reuses in every layer
    # How many of each sequence's query rows (its first ones) are prompt tokens; the rest are tokens the sequence
    # generated (a decode, a speculative step's drafts). None: one-row sequences decode, longer ones are prompt.
    prompt_rows: list[int] | None = None

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens) and not any(self.prompt_rows or ())

    def generated_rows(self, i: int) -> int:
        """How many of sequence i's query rows this step are generated tokens (they come after its prompt rows)."""
        n = self.query_lens[i]
        if self.prompt_rows is None:
            return 1 if n == 1 else 0
        return n - self.prompt_rows[i]


class AttentionBackend(Protocol):
    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None: ...
    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    kernels: CpuKernels = NO_KERNELS  # set once for the whole model when it loads (use_kernels)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (norm(residual + x), residual + x): the decoder's add-then-normalize."""
        if self.kernels.fused and x.is_contiguous():  # one pass (the add happens in `residual`)
            if residual is None:
                return torch.ops.pagekube_cpu.rms_norm(x, self.weight, self.eps)
            return torch.ops.pagekube_cpu.add_rms_norm(x, residual, self.weight, self.eps), residual
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Linear(nn.Linear):
    """nn.Linear through kernels.cpu_ops (AMX or small-batch kernels on CPUs that have them). `blocks`: the same
    weights in a GGUF file's Q4_1 or Q8_0 blocks (engine/model/layers/gguf_linears.py), read instead of `weight` by
    those kernels.
    `quant`: a quantized checkpoint's packed weights (engine/quantization/packed.py), kept in place of `weight`
    (then None). `lora`: its adapter slots with --enable-lora (engine/lora/slots.py), added to the base output."""

    blocks = None
    quant = None
    lora = None
    kernels: CpuKernels = NO_KERNELS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant.linear(x, self.bias, self.kernels.int_linear)
        else:
            y = self.kernels.matmul(x, self.weight, self.bias, self.blocks)
        return y if self.lora is None else self.lora.add(x, y)


def fused_linear(in_features: int, output_sizes: list[int], bias: bool) -> Linear:
    """Several projections of the same input as one Linear; `output_sizes` says which rows belong to which."""
    layer = Linear(in_features, sum(output_sizes), bias=bias)
    layer.output_sizes = output_sizes
    return layer


class Attention(nn.Module):
    kernels: CpuKernels = NO_KERNELS

    def __init__(self, config, layer_idx: int, shard: TPShard):
        super().__init__()
        heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        # This rank's heads (all of them without tensor parallelism): q/k/v column-parallel, o_proj row-parallel.
        self.num_heads, self.q_start = shard.split(heads)
        self.num_kv_heads, self.kv_start = shard.kv_heads(getattr(config, "num_key_value_heads", None) or heads)
        self.shard = shard
        self.scale = self.head_dim**-0.5
        self.layer_idx = layer_idx
        bias = getattr(config, "attention_bias", config.model_type == "qwen2")
        h = config.hidden_size
        # q, k and v in one GEMM (fewer, larger matmuls); the loader fills its rows from q_proj/k_proj/v_proj.
        self.qkv_proj = fused_linear(h, [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                                         self.num_kv_heads * self.head_dim], bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=getattr(config, "attention_bias", False)
                                and config.model_type != "qwen2")

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, backend: AttentionBackend):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        k_cache, v_cache = kv_cache
        if self.kernels.fused and qkv.is_contiguous():  # RoPE and the cache write in one pass
            q = torch.ops.pagekube_cpu.rope_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping,
                                                     self.num_heads, self.num_kv_heads)
        else:
            q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
            q = q.reshape(t, self.num_heads, self.head_dim)
            k = k.reshape(t, self.num_kv_heads, self.head_dim)
            v = v.reshape(t, self.num_kv_heads, self.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.attend(q, k_cache, v_cache, meta, self.scale)
        return all_reduce(self.o_proj(out.reshape(t, -1)), self.shard)


class MLP(nn.Module):
    kernels: CpuKernels = NO_KERNELS

    def __init__(self, config, shard: TPShard):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.size, self.start = shard.split(config.intermediate_size)  # gate/up column-, down row-parallel
        self.shard = shard
        self.gate_up_proj = fused_linear(config.hidden_size, [self.size] * 2, bias)  # gate, then up
        self.down_proj = Linear(self.size, config.hidden_size, bias=bias)
        self.act = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act == "silu"

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.silu and self.kernels.fused and gate_up.is_contiguous():
            h = torch.ops.pagekube_cpu.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = self.act(gate) * up
        return all_reduce(self.down_proj(h), self.shard)


class VocabEmbedding(nn.Module):
    """The embedding, or this rank's rows of it: ids outside them give zeros, and the all-reduce sums the ranks.
    `blocks`: its GGUF Q8_0 blocks where it is also the lm_head (tied), read by the CPU kernels for the logits."""

    blocks = None

    def __init__(self, vocab_size: int, hidden_size: int, shard: TPShard):
        super().__init__()
        self.rows, self.start, _ = shard.vocab(vocab_size)
        self.shard = shard
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        here = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * here[:, None].to(self.weight.dtype)
        return all_reduce(out, self.shard)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, shard: TPShard):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, shard)
        self.mlp = MLP(config, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin, kv_cache, meta, backend):
        """x: the previous layer's MLP output (the embeddings, with residual None, in the first layer).
        Returns this layer's MLP output and the residual stream before it, so each add fuses with the next norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, meta, backend), residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, config, shard: TPShard, stage: PPStage = PPStage()):
        super().__init__()
        self.stage = stage
        self.layer_range = stage.layers(config.num_hidden_layers)
        if stage.is_first or (stage.is_last and getattr(config, "tie_word_embeddings", False)):
            self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, shard)
        # Layers another pipeline stage holds are empty here, so parameter names stay the checkpoint's.
        self.layers = nn.ModuleList(DecoderLayer(config, i, shard) if i in self.layer_range else nn.Identity()
                                    for i in range(config.num_hidden_layers))
        if stage.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)  # transformers' RoPE: every rope_scaling type, same numbers

    @property
    def local_layers(self) -> list[DecoderLayer]:
        return [self.layers[i] for i in self.layer_range]

    def forward(self, input_ids, positions, kv_caches, meta, backend, intermediate=None):
        """The final hidden states; on a stage before the last, (hidden, residual) for the next stage, which passes
        them back in as `intermediate`."""
        x, residual = (self.embed_tokens(input_ids), None) if intermediate is None else intermediate
        cos, sin = self.rotary(x, positions)
        cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
        for layer, kv in zip(self.local_layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv, meta, backend)
        if not self.stage.is_last:
            return x, residual
        return self.norm(x, residual)[0]


def use_kernels(model: nn.Module, kernels: CpuKernels) -> None:
    """Every layer of `model` runs `kernels` from now on (chosen once per model: ModelRunner)."""
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels


class CausalLM(nn.Module):
    kernels: CpuKernels = NO_KERNELS

    supported_model_types = ("llama", "mistral", "qwen2", "smollm", "smollm3")
    # Checkpoint projection -> (fused parameter, index of its row block): HF names on disk, fused GEMMs in memory.
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, shard: TPShard = TPShard(), stage: PPStage = PPStage()):
        super().__init__()
        if config.model_type not in self.supported_model_types:
            raise ValueError(f"model_type {config.model_type!r} is not supported "
                             f"(supported: {', '.join(self.supported_model_types)})")
        self.config = config
        self.shard, self.stage = shard, stage
        self.model = DecoderModel(config, shard, stage)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if stage.is_last and not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, shard.vocab(config.vocab_size)[0], bias=False)

    def forward(self, input_ids, positions, kv_caches, meta, backend, intermediate=None):
        return self.model(input_ids, positions, kv_caches, meta, backend, intermediate)

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs on this pipeline stage (the loader reads no other)."""
        if self.stage.size == 1:
            return True
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers":
            return int(parts[1]) in self.model.layer_range
        if parts[0] == "embed_tokens":
            return hasattr(self.model, "embed_tokens")
        return self.stage.is_last  # norm, lm_head

    def checkpoint_target(self, name: str, params: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor] | None:
        """Where checkpoint tensor `name` goes: (parameter name, the view of it to copy into); None if unused.
        A base model's checkpoint (LlamaModel, MistralModel: embedding models) names its tensors without `model.`."""
        if name not in params and not name.startswith(("model.", "lm_head.")):
            name = "model." + name
        if name in params:
            return name, params[name]
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.stacked_params:
                fused, index = self.stacked_params[part]
                target = ".".join(parts[:i] + [fused] + parts[i + 1:])
                if target not in params:
                    return None
                sizes = self.get_submodule(".".join(parts[:i] + [fused])).output_sizes
                return target, params[target].narrow(0, sum(sizes[:index]), sizes[index])
        return None

    def projections(self, linear: str) -> list[str]:
        """The checkpoint projections a Linear of this model is loaded from, in row order (q, k, v for qkv_proj)."""
        *path, leaf = linear.split(".")
        parts = sorted((i, p) for p, (fused, i) in self.stacked_params.items() if fused == leaf) or [(0, leaf)]
        return [".".join([*path, p]) for _, p in parts]

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | str | None:
        """The part of checkpoint tensor `name` this rank holds: (dim, start, length); "zero" for a row-parallel
        bias off rank 0 (added once, after the all-reduce); None for all of it."""
        if self.shard.size == 1:
            return None
        *path, kind = name.split(".")
        leaf = path[-1] if path else ""
        layer = self.model.local_layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        hd = attn.head_dim
        if leaf == "q_proj":
            return 0, attn.q_start * hd, attn.num_heads * hd
        if leaf in ("k_proj", "v_proj"):
            return 0, attn.kv_start * hd, attn.num_kv_heads * hd
        if leaf in ("gate_proj", "up_proj"):
            return 0, mlp.start, mlp.size
        if leaf in ("o_proj", "down_proj"):
            if kind == "bias":
                return "zero" if self.shard.rank else None
            return (1, attn.q_start * hd, attn.num_heads * hd) if leaf == "o_proj" else (1, mlp.start, mlp.size)
        if leaf in ("embed_tokens", "lm_head"):
            _, start, real = self.shard.vocab(self.config.vocab_size)
            return 0, start, real
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits over the whole vocabulary (on rank 0; None on other ranks)."""
        head = self.model.embed_tokens if self.tie_word_embeddings else self.lm_head
        if hidden.device.type == "cpu" and hidden.shape[0] > 1 and not self.kernels.takes_linear(hidden):
            # MKL runs a tall [vocab, hidden] weight at half speed; slices of 2048 rows stay fast (1.7x at 32 rows).
            local = torch.cat([F.linear(hidden, w) for w in head.weight.split(2048)], dim=-1).float()
        else:
            local = self.kernels.matmul(hidden, head.weight, blocks=head.blocks).float()
        return gather_logits(local, self.shard, self.config.vocab_size)
