"""A GGUF file's Q4_1 linear weights, kept in their blocks for the CPU kernel (pagekube/kernels/q4_linear.cpp).

Q4_1 stores 32 weights as 4-bit q with a float16 scale d and minimum m (w = d*q + m): 0.625 bytes per weight,
against 2 for the bf16 copy the engine otherwise reads. A decode step at a few sequences is bound by reading the
weights, so the GGUF converter (model_files.convert_gguf) also writes these blocks, repacked for the kernel, and
the loader gives them to each Linear next to its bf16 weight (which larger batches still use: torch's GEMM).
Each tensor is checked against the dequantized one it stands for, rows included (the converter un-permutes
llama's q/k rows), so a name or layout this code does not know is skipped, never served wrong.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

log = logging.getLogger("pagekube.engine")

FILE = "q4_1_linears.safetensors"
BLOCK = 32


class Q4Weight(NamedTuple):
    qs: torch.Tensor  # [N, K/2] uint8: 32 bytes per two blocks, byte i = q[2p][i] | q[2p+1][i] << 4
    d: torch.Tensor  # [N, K/32] float16
    m: torch.Tensor  # [N, K/32] float16


def pack(blocks: np.ndarray) -> Q4Weight:
    """GGUF Q4_1 rows [N, K/32 blocks of 20 bytes: d, m, 16 bytes of nibbles] -> the kernel's layout."""
    n, nb, _ = blocks.shape
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
    nib = blocks[..., 4:]  # byte j: element j in the low nibble, element j + 16 in the high one
    q = np.concatenate([nib & 0xF, nib >> 4], axis=-1).reshape(n, nb // 2, 2, BLOCK)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, nb * BLOCK // 2)
    return Q4Weight(torch.from_numpy(qs.copy()), torch.from_numpy(d.copy()), torch.from_numpy(m.copy()))


def unpack(w: Q4Weight) -> torch.Tensor:
    """The float32 weights [N, K] a Q4Weight stands for (the reference the kernel is tested against)."""
    n = w.qs.shape[0]
    pairs = w.qs.view(n, -1, 1, BLOCK)
    q = torch.cat([pairs & 0xF, pairs >> 4], dim=2).reshape(n, -1, BLOCK).float()
    return (q * w.d.float()[..., None] + w.m.float()[..., None]).reshape(n, -1)


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types and f.types[0].name == "STRING" else int(value[0])


def _row_orders(n: int, heads: list[int]) -> list[np.ndarray]:
    """Row orders to try: as stored, and transformers' un-permutation of llama's q/k rows for each head count."""
    orders = [np.arange(n)]
    for h in heads:
        if h and n % (2 * h) == 0:
            orders.append(np.arange(n).reshape(h, n // h // 2, 2).swapaxes(1, 2).reshape(n))
    return orders


def extract(gguf_path: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Q4_1 linears of `gguf_path`, packed, named `<hf weight name>.{qs,d,m}`; `state` is the dequantized
    float32 state dict the converter wrote (each packed tensor must reproduce its entry exactly)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    archs = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in archs:
        return {}
    names = gguf.get_tensor_name_map(archs[arch], _field(reader, f"{arch}.block_count") or 0)
    heads = [_field(reader, f"{arch}.attention.head_count"), _field(reader, f"{arch}.attention.head_count_kv")]
    tensors = {t.name: t for t in reader.tensors}
    out, skipped = {}, []
    for hf_name, weight in state.items():
        if weight.dim() != 2 or not hf_name.endswith("_proj.weight"):
            continue
        t = tensors.get(names.get_name(hf_name, try_suffixes=(".weight",)) or "")
        if t is None or t.tensor_type != gguf.GGMLQuantizationType.Q4_1 or weight.shape[1] % (2 * BLOCK):
            continue
        rows, cols = weight.shape
        dequantized, expected = gguf.quants.dequantize(t.data, t.tensor_type), weight.numpy()
        order = next((o for o in _row_orders(rows, heads) if np.array_equal(dequantized[o], expected)), None)
        if order is None:
            skipped.append(hf_name)
            continue
        packed = pack(np.asarray(t.data).reshape(rows, cols // BLOCK, -1)[order])
        out.update({f"{hf_name}.{part}": tensor for part, tensor in packed._asdict().items()})
    if skipped:
        log.warning({"msg": "Q4_1 tensors that do not match their dequantized weights; bf16 only", "tensors": skipped})
    return out


def _rank_slice(tensor, part: str, cut) -> torch.Tensor | None:
    """The rows or input columns of one packed tensor ("qs", "d" or "m") that this tensor-parallel rank holds, cut
    as `CausalLM.checkpoint_slice` cuts the weight: rows as they are, columns by whole pairs of blocks (a "qs" byte
    holds two blocks' weights); None where a cut falls inside a pair (that Linear keeps the bf16 path)."""
    if cut is None:
        return tensor[:]
    dim, start, length = cut
    if dim == 0:
        return tensor[start:start + length]
    if start % (2 * BLOCK) or length % (2 * BLOCK):
        return None
    per = 2 if part == "qs" else BLOCK  # weights per stored column
    return tensor[:, start // per:(start + length) // per]


def attach(model: torch.nn.Module, model_dir: Path) -> int:
    """Give each Linear whose rows all have Q4_1 blocks in model_dir its Q4Weight (`.q4`); returns how many.
    Under tensor or pipeline parallelism each rank takes its own Linears' slices."""
    from safetensors import safe_open

    from pagekube.engine.model.model import Linear

    path = model_dir / FILE
    if not path.exists():
        return 0
    linears = {f"{name}.weight": mod for name, mod in model.named_modules() if isinstance(mod, Linear)}
    empty = {"qs": lambda n, k: torch.empty(n, k // 2, dtype=torch.uint8),
             "d": lambda n, k: torch.empty(n, k // BLOCK, dtype=torch.float16),
             "m": lambda n, k: torch.empty(n, k // BLOCK, dtype=torch.float16)}
    parts = {p: {w: make(*mod.weight.shape) for w, mod in linears.items()} for p, make in empty.items()}
    rows: dict[str, int] = {}
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            name, part = key.rsplit(".", 1)
            target = model.checkpoint_target(name, parts[part]) if model.holds(name) else None
            if target is None:  # a fused Linear's rows for q/k/v, gate/up; None: not on this pipeline stage
                continue
            tensor, dest = _rank_slice(f.get_slice(key), part, model.checkpoint_slice(name)), target[1]
            if tensor is None or tensor.shape != dest.shape:
                continue
            dest.copy_(tensor)
            if part == "qs":
                rows[target[0]] = rows.get(target[0], 0) + dest.shape[0]
    attached = 0
    for w, mod in linears.items():
        if rows.get(w) == mod.weight.shape[0]:
            mod.q4 = Q4Weight(parts["qs"][w], parts["d"][w], parts["m"][w])
            attached += 1
    return attached
