"""Attention backends: pure torch (CPU, and the reference) and Triton (GPU; also runs under TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch

from pagekube.engine.model import AttentionMetadata
from pagekube.kernels.reference import paged_attention_ref, write_kv_cache_ref


class TorchAttention:
    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc.tolist(),
                                   meta.context_lens_list, scale)


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
