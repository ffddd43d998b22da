"""Triton kernels for the paged KV cache: KV write, decode attention (split-K / flash-decoding) and prefill
attention over a cached prefix. Each matches a function of pagekube/kernels/reference.py (see the layout there).

They run on CUDA, and on the CPU under TRITON_INTERPRET=1 (how the tests check them against the reference).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# The interpreter (numpy) has no half-precision matmul: there, dots run in float32 (the loads stay half).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# ---- KV-cache write ------------------------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_vt,
                     ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW
    k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Store K/V [tokens, kv_heads, head_dim] at their slots; slot -1 is skipped."""
    if k.shape[0] == 0:
        return
    k, v = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
    if k.stride(1) != 1:
        k = k.contiguous()
    if v.stride(1) != 1:
        v = v.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    row = k.shape[1]
    _write_kv_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                    ROW=row, ROW_PAD=triton.next_power_of_2(row))


# ---- decode: one query token per sequence, split over the context -------------------------------------------
@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, ctx_ptr, m_ptr, l_ptr, acc_ptr, scale,
                         stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_tb, num_splits,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    q = q.to(tl.float32) * scale
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    num_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    first = split * BLOCKS_PER_SPLIT
    last = tl.minimum(first + BLOCKS_PER_SPLIT, num_blocks)
    offs = tl.arange(0, BLOCK_SIZE)
    for b in range(first, last):
        phys = tl.load(tables_ptr + seq * stride_tb + b).to(tl.int64)
        pos = b * BLOCK_SIZE + offs
        valid = pos < ctx
        kv_off = phys * stride_cb + offs[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_SIZE]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_cache_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    row = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split
    tl.store(m_ptr + row, m, mask=gmask)
    tl.store(l_ptr + row, denom, mask=gmask)
    tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _decode_reduce_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, stride_ot, stride_oh, num_splits,
                          HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    smask = s < num_splits
    row = (seq * tl.num_programs(1) + h) * num_splits + s
    m = tl.load(m_ptr + row, mask=smask, other=float("-inf"))
    denom = tl.load(l_ptr + row, mask=smask, other=0.0)
    acc = tl.load(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)  # empty splits weigh nothing
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(denom * w, axis=0)
    tl.store(out_ptr + seq * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def decode_num_splits(max_blocks: int) -> int:
    """Flash-decoding: long contexts are split so enough programs run; ~8 blocks per split, at most 64 splits."""
    return max(1, min(64, triton.cdiv(max_blocks, 8)))


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits: int | None = None,
                           out: torch.Tensor | None = None):
    """q [seqs, heads, head_dim] (one token per sequence) over each sequence's cached context."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    splits = num_splits or decode_num_splits(max_blocks)
    per_split = triton.cdiv(max_blocks, splits)
    m = torch.empty(num_seqs * num_heads * splits, dtype=torch.float32, device=q.device)
    denom = torch.empty_like(m)
    acc = torch.empty(num_seqs * num_heads * splits, head_dim, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, m, denom, acc, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        splits, GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCKS_PER_SPLIT=per_split)
    out = torch.empty_like(q) if out is None else out
    _decode_reduce_kernel[(num_seqs, num_heads)](m, denom, acc, out, out.stride(0), out.stride(1), splits,
                                                 HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(splits))
    return out


# ---- prefill: new query tokens attend causally to the cached prefix and to themselves -----------------------
@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, qsl_ptr, ctx_ptr, out_ptr, scale,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_tb,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                    IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq)
    kvh = h // GROUP
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < q_len
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=mmask[:, None],
                other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = ctx - q_len + offs_m
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last_key = tl.minimum(ctx, ctx - q_len + (mb + 1) * BLOCK_M)  # causal: later keys are never seen here
    offs = tl.arange(0, BLOCK_SIZE)
    for b in range(0, tl.cdiv(last_key, BLOCK_SIZE)):
        phys = tl.load(tables_ptr + seq * stride_tb + b).to(tl.int64)
        k_pos = b * BLOCK_SIZE + offs
        kv_off = phys * stride_cb + offs[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        kvalid = k_pos < ctx
        k = tl.load(k_cache_ptr + kv_off, mask=kvalid[:, None], other=0.0).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        allowed = (k_pos[None, :] <= q_pos[:, None]) & kvalid[None, :] & mmask[:, None]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows: keep them finite
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        v = tl.load(v_cache_ptr + kv_off, mask=kvalid[:, None], other=0.0).to(q.dtype)
        denom = denom * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


def paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, max_query_len: int,
                            scale, block_m: int = 16, out: torch.Tensor | None = None):
    """q [tokens, heads, head_dim], varlen over sequences (query_start_loc), each over its cached context."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    grid = (block_tables.shape[0], num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out, scale,
                          q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
                          k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
                          GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m,
                          IEEE=q.dtype == torch.float32, DOT_F32=INTERPRETED)
    return out
