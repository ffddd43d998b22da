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
        if meta.is_decode_only and len(meta.query_lens) > 1:
            return self._batched_decode(q, k_cache, v_cache, meta, scale)
        return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc.tolist(),
                                   meta.context_lens_list, scale)

    @staticmethod
    def _batched_decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """All decode tokens in one SDPA call over K/V gathered to the longest context (padding masked): a few
        ops per layer instead of a few per sequence, which is what costs on the CPU."""
        if "decode" not in meta.derived:
            bs = k_cache.shape[1]
            pos = torch.arange(max(meta.context_lens_list), device=q.device)
            slots = meta.block_tables[:, pos // bs].long() * bs + pos % bs
            mask = pos[None, :] < meta.context_lens[:, None]
            meta.derived["decode"] = (slots, mask[:, None, None, :])
        slots, mask = meta.derived["decode"]
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
