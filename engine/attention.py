"""Attention backends: pure torch (CPU, and the reference) and Triton (GPU; also runs under TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagekube.engine.model import AttentionMetadata
from pagekube.kernels.reference import paged_attention_ref, write_kv_cache_ref


class TorchAttention:
    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if "torch" not in meta.derived:  # the plan is the same for every layer of a step
            meta.derived["torch"] = self._plan(meta, k_cache.shape[1])
        decode_rows, slots, mask, prefills = meta.derived["torch"]
        if decode_rows is None:
            return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc.tolist(),
                                       meta.context_lens_list, scale)
        out = torch.empty_like(q)
        out[decode_rows] = self._batched_decode(q[decode_rows], k_cache, v_cache, slots, mask, scale)
        for i, s, e in prefills:  # prefill chunks one by one (each its own causal shape)
            out[s:e] = paged_attention_ref(q[s:e], k_cache, v_cache, meta.block_tables[i:i + 1], [0, e - s],
                                           [meta.context_lens_list[i]], scale)
        return out

    @staticmethod
    def _plan(meta: AttentionMetadata, block_size: int):
        """Split a step into its decode tokens (one query each: batched into one SDPA call over K/V gathered to
        the longest context, padding masked) and its prefill chunks. Fewer ops per layer is what counts on the
        CPU, and in continuous batching most steps are many decodes plus a chunk or two of a new prompt."""
        decodes = [i for i, n in enumerate(meta.query_lens) if n == 1]
        if len(decodes) < 2:
            return None, None, None, None
        starts = meta.query_start_loc.tolist()
        rows = torch.tensor([starts[i] for i in decodes], device=meta.block_tables.device)
        index = torch.tensor(decodes, device=meta.block_tables.device)
        lens = meta.context_lens[index]
        pos = torch.arange(max(meta.context_lens_list[i] for i in decodes), device=meta.block_tables.device)
        slots = meta.block_tables[index][:, pos // block_size].long() * block_size + pos % block_size
        mask = (pos[None, :] < lens[:, None])[:, None, None, :]
        prefills = [(i, starts[i], starts[i + 1]) for i, n in enumerate(meta.query_lens) if n > 1]
        return rows, slots, mask, prefills

    @staticmethod
    def _batched_decode(q, k_cache, v_cache, slots, mask, scale: float) -> torch.Tensor:
        k = k_cache.view(-1, *k_cache.shape[2:])[slots].transpose(1, 2)  # [seqs, kv_heads, ctx, dim]
        v = v_cache.view(-1, *v_cache.shape[2:])[slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(q[:, :, None, :], k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                             scale=scale, enable_gqa=True)
        return out[:, :, 0, :]


class TritonAttention:
    name = "triton"

    def __init__(self):
        from pagekube.kernels import triton_attention  # imported lazily: triton is only needed here

        self.ops = triton_attention

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self.ops.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.is_decode_only:
            return self.ops.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        return self.ops.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                                meta.context_lens, max(meta.query_lens), scale)


def make_backend(name: str, device: torch.device):
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    return TritonAttention() if name == "triton" else TorchAttention()
