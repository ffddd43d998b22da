"""Each on-disk quantized layout, read into packed.IntWeight / Fp8Weight (the integers as they are, repacked).

- compressed-tensors pack-quantized: `weight_packed` int32 [N, K*bits/32], column i at bit i*bits of its word
  (natural order), stored as q + 2^(bits-1); `weight_scale` [N, groups]; `weight_zero_point` (asymmetric) packed
  the same way along the rows; `weight_g_idx` [K] (act order); `weight_shape` [N, K].
- compressed-tensors float-quantized: `weight` float8_e4m3fn [N, K], `weight_scale` per tensor, row or block.
- AutoAWQ (GEMM): `qweight` int32 [K, N/8] packed along the output with nibble order 0,4,1,5,2,6,3,7;
  `qzeros` int32 [groups, N/8] the same way; `scales` [groups, N].
- GPTQ: `qweight` int32 [K*bits/32, N] packed along the input (natural order); `qzeros` [groups, N*bits/32]
  packed along the output (v1 stores zero - 1); `scales` [groups, N]; `g_idx` [K].
- FP8 (quant_method fp8): `weight` e4m3 [N, K] with `weight_scale` (per tensor) or `weight_scale_inv` (blocks).
Activation scales (`input_scale`) are accepted and unused: activations stay in the model dtype (weight-only FP8,
as vLLM runs FP8 on GPUs without FP8 tensor cores).
"""

from __future__ import annotations

import torch

from pagekube.engine.quantization.packed import Fp8Weight, IntWeight
from pagekube.engine.quantization.schemes import QuantizationError, WeightScheme

AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output column c of each 8 sits in nibble AWQ_ORDER[c] of its word

# The tensors each layout stores per Linear: required, then optional.
TENSORS = {
    "compressed-int": (("weight_packed", "weight_scale"), ("weight_shape", "weight_zero_point", "weight_g_idx")),
    "compressed-fp8": (("weight", "weight_scale"), ("input_scale",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "fp8": (("weight",), ("weight_scale", "weight_scale_inv", "input_scale")),
}


def suffixes(scheme: WeightScheme) -> set[str]:
    required, optional = TENSORS[scheme.layout]
    return {*required, *optional}


def read(scheme: WeightScheme, tensors: dict[str, torch.Tensor], name: str) -> IntWeight | Fp8Weight:
    """One projection's tensors (by suffix) -> its packed weight. `name` (the projection) is for messages."""
    required, optional = TENSORS[scheme.layout]
    missing = [s for s in required if s not in tensors]
    if missing:
        raise QuantizationError(f"{name}: {scheme.layout} checkpoint is missing {', '.join(missing)}")
    unknown = set(tensors) - set(required) - set(optional)
    if unknown:
        raise QuantizationError(f"{name}: tensors {sorted(unknown)} are not part of the {scheme.layout} layout")
    return READERS[scheme.layout](scheme, tensors, name)


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., W] with 8 4-bit values each (value i at bit 4i) -> uint8 [..., 8W] in that order."""
    b = words.contiguous().view(torch.uint8)  # little-endian: byte j holds values 2j (low) and 2j+1 (high)
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(*words.shape[:-1], -1)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] (values < 16) -> packed.IntWeight's [N, K/2] bytes."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def _values(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` unsigned values along the last dim of natural-order packed int32 words, as uint8."""
    values = nibbles(words) if bits == 4 else words.contiguous().view(torch.uint8)
    return values[..., :count]


def _no_trivial_g_idx(g_idx: torch.Tensor | None, group_size: int) -> torch.Tensor | None:
    """None where g_idx is just k // group_size (no act order): the kernels then read groups in column order."""
    if g_idx is None:
        return None
    g_idx = g_idx.long()
    plain = torch.arange(g_idx.numel()) // group_size
    return None if torch.equal(g_idx, plain) else g_idx


def _compressed_int(s: WeightScheme, t: dict, name: str) -> IntWeight:
    words = t["weight_packed"]
    n = words.shape[0]
    k = int(t["weight_shape"][1]) if "weight_shape" in t else words.shape[1] * 32 // s.bits
    if k % 2:
        raise QuantizationError(f"{name}: {k} input columns: 4-bit weights need an even count")
    scale = t["weight_scale"].float().reshape(n, -1)
    group = s.group_size or k
    if scale.shape[1] != -(-k // group):
        raise QuantizationError(f"{name}: weight_scale {tuple(scale.shape)} does not match {k} columns "
                                f"in groups of {group}")
    packed = words.contiguous().view(torch.uint8)[:, :k * s.bits // 8]
    offset = 1 << (s.bits - 1)
    zp = t.get("weight_zero_point")
    if zp is None:
        if not s.symmetric:
            raise QuantizationError(f"{name}: an asymmetric scheme without weight_zero_point")
        zero = torch.full(scale.shape, offset, dtype=torch.uint8)
    else:
        if zp.dtype == torch.int32 and zp.shape[0] != n:  # packed along the rows
            zero = _values(zp.t(), s.bits, n).t()
        else:  # unpacked signed values
            zero = (zp.to(torch.int32).reshape(scale.shape) + offset).to(torch.uint8)
    return IntWeight(packed.contiguous(), scale, zero.contiguous(), s.bits, group,
                     _no_trivial_g_idx(t.get("weight_g_idx"), group))


def _fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block, name: str) -> Fp8Weight:
    if weight.dtype != torch.float8_e4m3fn:
        raise QuantizationError(f"{name}: FP8 weight of dtype {weight.dtype} (float8_e4m3fn expected)")
    n, k = weight.shape
    scale = scale.float()
    if block is None:
        scale = scale.reshape(-1, 1)
        if scale.shape[0] not in (1, n):
            raise QuantizationError(f"{name}: weight scale of {scale.numel()} values for {n} rows")
    elif tuple(scale.shape) != (-(-n // block[0]), -(-k // block[1])):
        raise QuantizationError(f"{name}: block scales {tuple(scale.shape)} do not match {n}x{k} in {block} blocks")
    return Fp8Weight(weight, scale, tuple(block) if block else None)


def _compressed_fp8(s: WeightScheme, t: dict, name: str) -> Fp8Weight:
    return _fp8_weight(t["weight"], t["weight_scale"], s.block, name)


def _fp8(s: WeightScheme, t: dict, name: str) -> Fp8Weight:
    if s.block is not None:
        if "weight_scale_inv" not in t:
            raise QuantizationError(f"{name}: block-scaled FP8 checkpoint is missing weight_scale_inv")
        return _fp8_weight(t["weight"], t["weight_scale_inv"], s.block, name)
    if "weight_scale" not in t:
        raise QuantizationError(f"{name}: FP8 checkpoint is missing weight_scale")
    return _fp8_weight(t["weight"], t["weight_scale"], None, name)


def _group_scales(s: WeightScheme, scales: torch.Tensor, zeros: torch.Tensor, k: int, name: str):
    """AWQ/GPTQ [groups, N] scales and zeros -> [N, groups], with the group size checked against K."""
    group = s.group_size or k
    if scales.shape[0] != -(-k // group):
        raise QuantizationError(f"{name}: {scales.shape[0]} scale groups for {k} columns in groups of {group}")
    return group, scales.float().t().contiguous(), zeros.t().contiguous()


def _awq(s: WeightScheme, t: dict, name: str) -> IntWeight:
    qweight, qzeros = t["qweight"], t["qzeros"]
    k = qweight.shape[0]
    order = torch.tensor(AWQ_ORDER)

    def columns(words):  # [rows, N/8] words -> [rows, N] values in column order
        v = nibbles(words).view(words.shape[0], -1, 8)
        return v[:, :, order].reshape(words.shape[0], -1)

    q = columns(qweight).t()
    group, scale, zero = _group_scales(s, t["scales"], columns(qzeros), k, name)
    return IntWeight(pack_nibbles(q), scale, zero, 4, group)


def _gptq(s: WeightScheme, t: dict, name: str) -> IntWeight:
    qweight = t["qweight"]
    n, k = qweight.shape[1], qweight.shape[0] * 32 // s.bits
    packed = qweight.t().contiguous().view(torch.uint8)  # natural order along K: already packed.IntWeight's bytes
    zeros = _values(t["qzeros"], s.bits, n).to(torch.int16) + (1 if s.gptq_v1_zeros else 0)
    group, scale, zero = _group_scales(s, t["scales"], zeros.to(torch.uint8), k, name)
    return IntWeight(packed, scale, zero, s.bits, group, _no_trivial_g_idx(t.get("g_idx"), group))


READERS = {"compressed-int": _compressed_int, "compressed-fp8": _compressed_fp8, "awq": _awq, "gptq": _gptq,
           "fp8": _fp8}
