"""Quantized weights as the Linears keep them in memory: packed integers or FP8, never dequantized at load.

Every on-disk layout (layouts.py) becomes one of these, so the kernels and tensor parallelism see one form each.
A fused Linear (q/k/v, gate/up) holds one per checkpoint projection (`QuantizedWeight.parts`): their groups,
scales and act-order column orders are their own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class IntWeight:
    """w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = g_idx[k], or k // group_size without act order."""

    packed: torch.Tensor  # uint8 [N, K] (8 bits) or [N, K/2] (4 bits: column 2i in the low nibble, 2i+1 high)
    scale: torch.Tensor  # float32 [N, groups]
    zero: torch.Tensor  # uint8 [N, groups]: unsigned zero points (2^(bits-1) where symmetric)
    bits: int
    group_size: int  # input columns per group (K for one group per row)
    g_idx: torch.Tensor | None = None  # int64 [K]: each column's group (act order: not in column order)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 8 // self.bits

    def unpack(self) -> torch.Tensor:
        """q as uint8 [N, K]."""
        if self.bits == 8:
            return self.packed
        return torch.stack([self.packed & 0xF, self.packed >> 4], dim=-1).reshape(self.shape)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Computed in float32 as compressed-tensors does ((q - zero) * scale), then rounded once to `dtype`."""
        n, k = self.shape
        q = self.unpack().float()
        if self.g_idx is not None:
            return ((q - self.zero[:, self.g_idx].float()) * self.scale[:, self.g_idx]).to(dtype)
        q = q.view(n, -1, self.group_size)
        return ((q - self.zero.float()[..., None]) * self.scale[..., None]).reshape(n, k).to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> IntWeight:
        """Rows (dim 0) or input columns (dim 1) start:start+length: one tensor-parallel rank's part (a copy, so
        the whole tensor it came from is freed)."""
        return contiguous(self._narrow(dim, start, length))

    def _narrow(self, dim: int, start: int, length: int) -> IntWeight:
        if dim == 0:
            return replace(self, packed=self.packed[start:start + length], scale=self.scale[start:start + length],
                           zero=self.zero[start:start + length])
        per_byte = 8 // self.bits
        if start % per_byte or length % per_byte:
            raise ValueError(f"cannot split {self.bits}-bit weights at column {start}")
        packed = self.packed[:, start // per_byte:(start + length) // per_byte]
        if self.g_idx is not None:  # act order: every group may have columns here, keep all their scales
            return replace(self, packed=packed, g_idx=self.g_idx[start:start + length])
        if start % self.group_size or length % self.group_size:
            raise ValueError(f"a tensor-parallel split at input column {start} cuts a quantization group of "
                             f"{self.group_size} columns; choose a --tensor-parallel-size that splits whole groups")
        g0, g1 = start // self.group_size, (start + length) // self.group_size
        return replace(self, packed=packed, scale=self.scale[:, g0:g1], zero=self.zero[:, g0:g1])


@dataclass
class Fp8Weight:
    """w = weight * scale: scale [1, 1] per tensor, [N, 1] per row, or [N/block[0], K/block[1]] per block."""

    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32
    block: tuple[int, int] | None = None

    def row_scales(self) -> tuple[torch.Tensor, int] | None:
        """The scales as [N, groups] with `group_size` columns each, as the CPU kernel reads them; None where
        blocks do not tile the columns."""
        k = self.shape[1]
        if self.block is not None and k % self.block[1]:
            return None
        return self._scales_per_row().contiguous(), k if self.block is None else self.block[1]

    def _scales_per_row(self) -> torch.Tensor:
        """[N, 1] (per tensor or per row) or [N, K/block[1]] (per block): each row's own scales."""
        n = self.shape[0]
        return self.scale.expand(n, 1) if self.block is None else self.scale.repeat_interleave(self.block[0], 0)[:n]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        scale = self._scales_per_row()
        if self.block is not None:
            scale = scale.repeat_interleave(self.block[1], 1)[:, :self.shape[1]]
        return (self.weight.float() * scale).to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> Fp8Weight:
        weight = self.weight.narrow(dim, start, length)
        if self.block is not None:
            size = self.block[dim]
            if start % size:
                raise ValueError(f"a tensor-parallel split at {start} cuts an FP8 block of {size}")
            scale = self.scale.narrow(dim, start // size, -(-length // size))
        elif dim == 0 and self.scale.shape[0] > 1:
            scale = self.scale[start:start + length]
        else:
            scale = self.scale
        return contiguous(replace(self, weight=weight, scale=scale))


KERNEL_MAX_ROWS = 64  # measured crossover with dequantize-then-matmul (bench/quantized.py, docs/benchmarks.md)


def _kernel_args(p: IntWeight | Fp8Weight) -> tuple | None:
    """(the CPU kernel, its arguments after x) for one part; None where the kernel does not read it."""
    if p.shape[1] % 8:
        return None
    if isinstance(p, Fp8Weight):
        scales = p.row_scales()
        if scales is None or scales[1] % 8:
            return None
        return torch.ops.pagekube_int.fp8_linear, (p.weight.contiguous().view(torch.uint8), *scales)
    if p.g_idx is not None or p.group_size % 8:
        return None
    return torch.ops.pagekube_int.int_linear, (p.packed.contiguous(), p.scale.contiguous(), p.zero.contiguous(),
                                               p.bits, p.group_size)


def _triton_args(p: IntWeight | Fp8Weight) -> tuple | None:
    """The GPU kernel's arguments after x for one part (pagekube/kernels/triton_quant.py); None where it does not
    read it (FP8 blocks that do not tile the columns)."""
    from pagekube.kernels.triton_quant import FP8, INT4, INT8  # lazily: triton is only needed on the GPU

    if isinstance(p, Fp8Weight):
        scales = p.row_scales()
        return None if scales is None else (p.weight.contiguous().view(torch.uint8), scales[0], None, FP8, scales[1])
    return p.packed.contiguous(), p.scale.contiguous(), p.zero.contiguous(), INT4 if p.bits == 4 else INT8, \
        p.group_size, p.g_idx


@dataclass
class QuantizedWeight:
    """A Linear's weight as its checkpoint projections, stacked by rows (one part unless the Linear is fused)."""

    parts: list[IntWeight | Fp8Weight]
    kernel_args: list | None = None  # per part, what the CPU kernel is called with (built on first use)
    triton_args: list | None = None  # the same for the GPU's Triton kernel

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0].dequantize(dtype)
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, kernel: bool) -> torch.Tensor:
        """x @ w.T (+ bias). On CUDA: the Triton kernel (triton_linear). `kernel`: the CPU's int4/int8/FP8 kernel
        (pagekube/kernels/int_linear.cpp) where every part is one it reads (no act order) and the step has at
        most KERNEL_MAX_ROWS rows. Otherwise the weights dequantized, then torch's matmul."""
        if x.is_cuda:
            y = self.triton_linear(x)
            if y is not None:
                return y if bias is None else y + bias
        if kernel and x.shape[0] <= KERNEL_MAX_ROWS:
            if self.kernel_args is None:
                self.kernel_args = [_kernel_args(p) for p in self.parts]
            if all(a is not None for a in self.kernel_args):
                xf = x.float().contiguous()
                ys = [op(xf, *args) for op, args in self.kernel_args]
                y = (ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)).to(x.dtype)
                return y if bias is None else y + bias
        return torch.nn.functional.linear(x, self.dequantize(x.dtype), bias)

    def triton_linear(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ w.T through pagekube/kernels/triton_quant.py, the weights dequantized tile by tile in registers;
        None where a part is one it does not read."""
        from pagekube.kernels.triton_quant import quant_linear

        if self.triton_args is None:
            self.triton_args = [_triton_args(p) for p in self.parts]
        if any(a is None for a in self.triton_args):
            return None
        x2 = x.reshape(-1, x.shape[-1])
        ys = [quant_linear(x2, *args) for args in self.triton_args]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.parts for t in vars(p).values()
                   if isinstance(t, torch.Tensor))


def _each_tensor(weight: IntWeight | Fp8Weight, fn) -> IntWeight | Fp8Weight:
    return replace(weight, **{k: fn(v) for k, v in vars(weight).items() if isinstance(v, torch.Tensor)})


def to_device(weight: IntWeight | Fp8Weight, device: torch.device) -> IntWeight | Fp8Weight:
    return _each_tensor(weight, lambda t: t.to(device))


def contiguous(weight: IntWeight | Fp8Weight) -> IntWeight | Fp8Weight:
    return _each_tensor(weight, torch.Tensor.contiguous)
