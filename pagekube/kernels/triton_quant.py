"""Triton GEMM over a quantized checkpoint's packed weights (the GPU's W4A16 / W8A16 / weight-only FP8): each
program dequantizes a tile of weights in registers, as compressed-tensors computes them ((q - zero) * scale in
float32, then the activations' dtype), and multiplies it with a tile of x. The weights stay packed in memory.

Layouts are engine/quantization/packed.py's: int4 [N, K/2] uint8 (column 2i in the low nibble), int8 [N, K],
FP8 e4m3 [N, K] read as uint8; scale [N, groups] float32; zero [N, groups] uint8 (int only); g_idx [K] (act
order: each column's group). Matches dequantize-then-matmul (tests/test_triton_kernels.py, under
TRITON_INTERPRET=1 on the CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagekube.kernels.triton_attention import INTERPRETED

INT4, INT8, FP8 = 0, 1, 2


@triton.jit
def _fp8_e4m3_to_f32(bits):
    """e4m3 byte -> float32, exactly (subnormals too): sign to bit 31, exponent+mantissa to bits 20..26, which is
    the value times 2^-120 as a float32; the multiply undoes that."""
    bits = bits.to(tl.int32)
    word = ((bits & 0x80) << 24) | ((bits & 0x7F) << 20)
    return word.to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120


@triton.jit
def _quant_gemm_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, gidx_ptr, y_ptr, M, N, K, GROUP,
                       stride_xm, stride_wn, stride_sn, stride_ym,
                       MODE: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_GIDX: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = m < M, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        xb = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :],
                     mask=mmask[:, None] & kmask[None, :], other=0.0)
        wmask = nmask[:, None] & kmask[None, :]
        rows = n[:, None].to(tl.int64)
        if MODE == 0:  # int4: two columns a byte
            byte = tl.load(w_ptr + rows * stride_wn + (k // 2)[None, :], mask=wmask, other=0).to(tl.int32)
            q = ((byte >> ((k % 2) * 4)[None, :]) & 0xF).to(tl.float32)
        elif MODE == 1:
            q = tl.load(w_ptr + rows * stride_wn + k[None, :], mask=wmask, other=0).to(tl.float32)
        else:
            q = _fp8_e4m3_to_f32(tl.load(w_ptr + rows * stride_wn + k[None, :], mask=wmask, other=0))
        if HAS_GIDX:
            g = tl.load(gidx_ptr + k, mask=kmask, other=0)
        else:
            g = k // GROUP
        sidx = rows * stride_sn + g[None, :]
        scale = tl.load(scale_ptr + sidx, mask=wmask, other=0.0)
        if HAS_ZERO:
            q = q - tl.load(zero_ptr + sidx, mask=wmask, other=0).to(tl.float32)
        w = (q * scale).to(xb.dtype)  # rounded once to the activations' dtype, as dequantize() does
        if DOT_F32:
            xb, w = xb.to(tl.float32), w.to(tl.float32)
        if IEEE:
            acc += tl.dot(xb, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(xb, tl.trans(w))
    tl.store(y_ptr + m[:, None].to(tl.int64) * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def quant_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 mode: int, group_size: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantized(weight).T -> [M, N] in x's dtype. `weight`: uint8 (int4 packed, int8, or FP8 bytes);
    `scale`/`zero` [N, groups]; `group_size` columns per group unless `g_idx` gives each column's group."""
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    assert weight.dtype == torch.uint8 and weight.is_contiguous() and scale.is_contiguous()
    assert weight.shape[1] == (k // 2 if mode == INT4 else k), "weight columns do not match x"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 64
    _quant_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, weight, scale, zero if zero is not None else scale, g_idx if g_idx is not None else scale, y,
        m, n, k, group_size, x.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        MODE=mode, HAS_ZERO=zero is not None, HAS_GIDX=g_idx is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, DOT_F32=INTERPRETED)
    return y
