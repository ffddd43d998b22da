"""Attention over a packed batch: sequences laid end to end (no padding), each attending only to itself.

Pooling requests keep no KV cache: K and V of this forward are all there is. Encoders attend both ways, decoders
causally. `PackedCausalAttention` lets the generation model's decoder layers (engine/model/model.py) run this
way: they write K/V through the slot mapping into a scratch buffer of this step's tokens, then attend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagekube.engine.model.model import AttentionMetadata
from pagekube.kernels.reference import write_kv_cache_ref


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scale: float,
                     causal: bool) -> torch.Tensor:
    """q [tokens, heads, dim], k/v [tokens, kv_heads, dim]; sequence i is rows bounds[i]:bounds[i+1].
    One SDPA call per sequence: its own shape, no mask, no padding read."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    # [1, heads, tokens, dim] views: a 4-D input takes torch's flash kernel on the CPU, 3-D the slow math path
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
    for s, e in zip(bounds, bounds[1:]):
        out[s:e] = F.scaled_dot_product_attention(qt[:, :, s:e], kt[:, :, s:e], vt[:, :, s:e], is_causal=causal,
                                                  scale=scale, enable_gqa=gqa)[0].transpose(0, 1)
    return out


def packed_metadata(bounds: list[int], device: torch.device) -> AttentionMetadata:
    """The decoder layers' metadata for a packed batch: token i's K/V goes to scratch slot i."""
    tokens = bounds[-1]
    lens = [e - s for s, e in zip(bounds, bounds[1:])]
    return AttentionMetadata(slot_mapping=torch.arange(tokens, device=device), block_tables=torch.empty(0),
                             query_start_loc=torch.tensor(bounds, dtype=torch.int32), context_lens=torch.tensor(lens),
                             query_lens=lens, context_lens_list=lens, derived={"bounds": bounds})


class PackedCausalAttention:
    """An attention backend (engine/model/model.py's protocol) for a decoder's pooling forward."""

    name = "packed"

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        bounds = meta.derived["bounds"]
        k = k_cache.view(-1, *k_cache.shape[2:])[:bounds[-1]]
        v = v_cache.view(-1, *v_cache.shape[2:])[:bounds[-1]]
        return packed_attention(q, k, v, bounds, scale, causal=True)
