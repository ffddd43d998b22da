"""Pure-torch references: the CPU attention backend and the ground truth the Triton kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Store new tokens' K/V [tokens, kv_heads, head_dim] at their slots (block * block_size + offset); -1 skips."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first `context_len` tokens of one sequence, [context_len, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    return cache.index_select(0, block_table[:num_blocks].long()).flatten(0, 1)[:context_len]  # row copies


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: list[int] | torch.Tensor, context_lens: list[int] | torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new query tokens over its whole cached context (prefix + new)."""
    out = torch.empty_like(q)
    starts = [int(x) for x in query_start_loc]
    lens = [int(x) for x in context_lens]
    for i, ctx in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        if e == s:
            continue
        k = gather_kv(k_cache, block_tables[i], ctx).to(q.dtype)
        v = gather_kv(v_cache, block_tables[i], ctx).to(q.dtype)
        # 4-D inputs with enable_gqa: the CPU flash kernel (3-D falls back to the math path, and repeating K/V
        # for GQA copies them), 2-3x faster prefill attention on the CPU.
        qi = q[s:e].transpose(0, 1)[None]  # [1, heads, q_len, d]
        k = k.transpose(0, 1)[None]  # [1, kv_heads, ctx, d]
        v = v.transpose(0, 1)[None]
        q_len = e - s
        if q_len == 1 or q_len == ctx:  # plain causal: the same SDPA call transformers makes
            mask = None
        else:  # query j sits at position ctx - q_len + j and sees keys up to there
            pos_q = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
            mask = torch.arange(ctx, device=q.device)[None, :] <= pos_q
        causal = mask is None and q_len > 1
        out[s:e] = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                  enable_gqa=True)[0].transpose(0, 1)
    return out


def lora_shrink_expand_ref(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           segments: torch.Tensor) -> torch.Tensor:
    """Batched LoRA over segments (start row, rows, slot): y[rows] += (x[rows] @ a[slot].T) @ b[slot].T."""
    for start, rows, slot in segments.tolist():
        s = slice(start, start + rows)
        y[s] += ((x[s].float() @ a[slot].float().T) @ b[slot].float().T).to(y.dtype)
    return y
