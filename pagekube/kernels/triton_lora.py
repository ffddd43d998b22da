"""Triton kernels for batched LoRA over segments (Punica's SGMV): a step's rows come in segments of contiguous
rows that share an adapter slot; the shrink computes `xa = x @ A[slot].T` per segment, the expand adds
`xa @ B[slot].T` into the base Linear's output. Matches `lora_shrink_expand_ref` (pagekube/kernels/reference.py).

Layout: x [tokens, in]; y [tokens, out] (updated in place); a [slots, width, in]; b [slots, out, width], zeros past
an adapter's own width; segments [n, 3] int32 rows of (start row, rows, slot). Runs on CUDA, and on the CPU under
TRITON_INTERPRET=1 (how the tests check it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagekube.kernels.triton_attention import INTERPRETED


@triton.jit
def _segment_block(seg_ptr, BLOCK_M: tl.constexpr):
    """This program's rows: block program_id(1) of segment program_id(0); `empty` past the segment's end."""
    seg = tl.program_id(0)
    mb = tl.program_id(1)
    start = tl.load(seg_ptr + seg * 3)
    rows = tl.load(seg_ptr + seg * 3 + 1)
    slot = tl.load(seg_ptr + seg * 3 + 2).to(tl.int64)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    return (start + offs_m).to(tl.int64), offs_m < rows, slot, mb * BLOCK_M >= rows


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, xa_ptr, seg_ptr, K, W, stride_xt, stride_as, stride_aw, stride_xat,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, W_PAD: tl.constexpr, IEEE: tl.constexpr,
                   DOT_F32: tl.constexpr):
    t, mmask, slot, empty = _segment_block(seg_ptr, BLOCK_M)
    if empty:
        return
    w = tl.arange(0, W_PAD)
    acc = tl.zeros([BLOCK_M, W_PAD], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xb = tl.load(x_ptr + t[:, None] * stride_xt + k[None, :], mask=mmask[:, None] & (k[None, :] < K), other=0.0)
        ab = tl.load(a_ptr + slot * stride_as + w[:, None] * stride_aw + k[None, :],
                     mask=(w[:, None] < W) & (k[None, :] < K), other=0.0)
        if DOT_F32:
            xb, ab = xb.to(tl.float32), ab.to(tl.float32)
        if IEEE:
            acc += tl.dot(xb, tl.trans(ab), input_precision="ieee")
        else:
            acc += tl.dot(xb, tl.trans(ab))
    tl.store(xa_ptr + t[:, None] * stride_xat + w[None, :], acc, mask=mmask[:, None] & (w[None, :] < W))


@triton.jit
def _expand_kernel(xa_ptr, b_ptr, y_ptr, seg_ptr, N, W, stride_xat, stride_bs, stride_bn, stride_yt,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W_PAD: tl.constexpr, IEEE: tl.constexpr):
    t, mmask, slot, empty = _segment_block(seg_ptr, BLOCK_M)
    if empty:
        return
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = tl.arange(0, W_PAD)
    xa = tl.load(xa_ptr + t[:, None] * stride_xat + w[None, :], mask=mmask[:, None] & (w[None, :] < W), other=0.0)
    bb = tl.load(b_ptr + slot * stride_bs + n[:, None] * stride_bn + w[None, :],
                 mask=(n[:, None] < N) & (w[None, :] < W), other=0.0).to(tl.float32)
    if IEEE:
        delta = tl.dot(xa, tl.trans(bb), input_precision="ieee")
    else:
        delta = tl.dot(xa, tl.trans(bb))
    out = y_ptr + t[:, None] * stride_yt + n[None, :]
    omask = mmask[:, None] & (n[None, :] < N)
    y = tl.load(out, mask=omask, other=0.0).to(tl.float32)
    tl.store(out, (y + delta).to(y_ptr.dtype.element_ty), mask=omask)


def lora_shrink_expand(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: torch.Tensor,
                       max_segment: int, block_m: int = 16) -> torch.Tensor:
    """y += (x @ A[slot].T) @ B[slot].T over each segment's rows; returns y."""
    tokens, k = x.shape
    _, width, _ = a.shape
    n = b.shape[1]
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    xa = torch.zeros(tokens, width, dtype=torch.float32, device=x.device)
    w_pad = max(16, triton.next_power_of_2(width))
    m_blocks = triton.cdiv(max_segment, block_m)
    ieee = x.dtype == torch.float32
    _shrink_kernel[(segments.shape[0], m_blocks)](x, a, xa, segments, k, width, x.stride(0), a.stride(0), a.stride(1),
                                                  xa.stride(0), BLOCK_M=block_m, BLOCK_K=64, W_PAD=w_pad, IEEE=ieee,
                                                  DOT_F32=INTERPRETED)
    block_n = 64
    _expand_kernel[(segments.shape[0], m_blocks, triton.cdiv(n, block_n))](
        xa, b, y, segments, n, width, xa.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, W_PAD=w_pad, IEEE=ieee)
    return y
