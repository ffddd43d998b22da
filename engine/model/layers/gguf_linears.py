"""A GGUF file's quantized weights, kept in their blocks for the CPU kernels (pagekube/kernels/gguf_linear.cpp).

Q4_1 stores 32 weights as 4-bit q with a float16 scale d and minimum m (w = d*q + m): 0.625 bytes per weight. Q8_0
stores them as int8 q with a scale (w = d*q): 1.0625 bytes. The bf16 copy the engine otherwise reads takes 2. A
decode step at a few sequences is bound by reading the weights, so the GGUF converter (model_files.convert_gguf)
also writes these blocks, repacked for the kernels: every Q4_1 projection, and the Q8_0 embedding of a model whose
lm_head is tied to it (the bundled model's: 57 MB of bf16 read per step, 30 MB as blocks). The loader gives them
to each Linear (and to the tied embedding, for the lm_head) next to its bf16 weight, whose exact values the kernels
compute with. Each tensor is checked against the dequantized one it stands for, rows included (the converter
un-permutes llama's q/k rows), so a name or layout this code does not know is skipped, never served wrong.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

log = logging.getLogger("pagekube.engine")

FILE = "gguf_blocks.safetensors"
BLOCK = 32


class Q4Weight(NamedTuple):
    qs: torch.Tensor  # [N, K/2] uint8: 32 bytes per two blocks, byte i = q[2p][i] | q[2p+1][i] << 4
    d: torch.Tensor  # [N, K/32] float16
    m: torch.Tensor  # [N, K/32] float16

    @staticmethod
    def empty(n: int, k: int) -> Q4Weight:
        return Q4Weight(torch.empty(n, k // 2, dtype=torch.uint8), torch.empty(n, k // BLOCK, dtype=torch.float16),
                        torch.empty(n, k // BLOCK, dtype=torch.float16))

    @staticmethod
    def weights_per_column(part: str) -> int:
        return 2 if part == "qs" else BLOCK  # a "qs" byte holds two blocks' weights


class Q8Weight(NamedTuple):
    qs: torch.Tensor  # [N, K] int8
    d: torch.Tensor  # [N, K/32] float16

    @staticmethod
    def empty(n: int, k: int) -> Q8Weight:
        return Q8Weight(torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // BLOCK, dtype=torch.float16))

    @staticmethod
    def weights_per_column(part: str) -> int:
        return 1 if part == "qs" else BLOCK


def pack(blocks: np.ndarray) -> Q4Weight:
    """GGUF Q4_1 rows [N, K/32 blocks of 20 bytes: d, m, 16 bytes of nibbles] -> the kernel's layout."""
    n, nb, _ = blocks.shape
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
    nib = blocks[..., 4:]  # byte j: element j in the low nibble, element j + 16 in the high one
    q = np.concatenate([nib & 0xF, nib >> 4], axis=-1).reshape(n, nb // 2, 2, BLOCK)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, nb * BLOCK // 2)
    return Q4Weight(torch.from_numpy(qs.copy()), torch.from_numpy(d.copy()), torch.from_numpy(m.copy()))


def pack_q8(blocks: np.ndarray) -> Q8Weight:
    """GGUF Q8_0 rows [N, K/32 blocks of 34 bytes: d, 32 int8] -> the kernel's layout."""
    n, nb, _ = blocks.shape
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    qs = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, nb * BLOCK)
    return Q8Weight(torch.from_numpy(qs.copy()), torch.from_numpy(d.copy()))


PACKERS = {"Q4_1": pack, "Q8_0": pack_q8}


def unpack(w: Q4Weight | Q8Weight) -> torch.Tensor:
    """The float32 weights [N, K] a Q4Weight or Q8Weight stands for (the reference the kernels are tested against)."""
    n = w.qs.shape[0]
    if isinstance(w, Q8Weight):
        return (w.qs.view(n, -1, BLOCK).float() * w.d.float()[..., None]).reshape(n, -1)
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


def kept(hf_name: str, state: dict[str, torch.Tensor]) -> bool:
    """Whether a weight is read in blocks: the projections, and the embedding where it is also the lm_head (tied:
    the converter wrote no lm_head)."""
    return hf_name.endswith("_proj.weight") or hf_name == "lm_head.weight" or (
        hf_name == "model.embed_tokens.weight" and "lm_head.weight" not in state)


def extract(gguf_path: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Q4_1 and Q8_0 weights of `gguf_path` that `kept` names, packed, named `<hf weight name>.{qs,d,m}`
    (Q4_1) or `.{qs,d}` (Q8_0, whose qs are int8); `state` is the dequantized float32 state dict the converter
    wrote (each packed tensor must reproduce its entry exactly)."""
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
        if weight.dim() != 2 or not kept(hf_name, state):
            continue
        t = tensors.get(names.get_name(hf_name, try_suffixes=(".weight",)) or "")
        if t is None or t.tensor_type.name not in PACKERS or weight.shape[1] % (2 * BLOCK):
            continue
        rows, cols = weight.shape
        dequantized, expected = gguf.quants.dequantize(t.data, t.tensor_type), weight.numpy()
        order = next((o for o in _row_orders(rows, heads) if np.array_equal(dequantized[o], expected)), None)
        if order is None:
            skipped.append(hf_name)
            continue
        packed = PACKERS[t.tensor_type.name](np.asarray(t.data).reshape(rows, cols // BLOCK, -1)[order])
        out.update({f"{hf_name}.{part}": tensor for part, tensor in packed._asdict().items()})
    if skipped:
        log.warning({"msg": "GGUF blocks that do not match their dequantized weights; bf16 only", "tensors": skipped})
    return out


def _rank_slice(tensor, part: str, cut, fmt) -> torch.Tensor | None:
    """The rows or input columns of one packed tensor ("qs", "d" or "m") that this tensor-parallel rank holds, cut
    as `CausalLM.checkpoint_slice` cuts the weight: rows as they are, columns by whole pairs of blocks (a Q4_1 "qs"
    byte holds two blocks' weights, and the kernels take K in pairs); None where a cut falls inside a pair (that
    Linear keeps the bf16 path)."""
    if cut is None:
        return tensor[:]
    dim, start, length = cut
    if dim == 0:
        return tensor[start:start + length]
    if start % (2 * BLOCK) or length % (2 * BLOCK):
        return None
    per = fmt.weights_per_column(part)
    return tensor[:, start // per:(start + length) // per]


def attach(model: torch.nn.Module, model_dir: Path) -> int:
    """Give each Linear (and the tied embedding) whose rows all have blocks in model_dir its Q4Weight or Q8Weight
    (`.blocks`); returns how many. Under tensor or pipeline parallelism each rank takes its own slices."""
    from safetensors import safe_open

    from pagekube.engine.model.model import Linear, VocabEmbedding

    path = model_dir / FILE
    if not path.exists():
        return 0
    weights = {f"{name}.weight": mod.weight for name, mod in model.named_modules()
               if isinstance(mod, (Linear, VocabEmbedding))}
    with safe_open(path, framework="pt") as f:
        targets = {}  # checkpoint name -> (this model's weight name, the format its blocks are in)
        for key in f.keys():
            name, part = key.rsplit(".", 1)
            target = model.checkpoint_target(name, weights) if part == "qs" and model.holds(name) else None
            if target is not None:  # None: a fused Linear's rows for q/k/v, gate/up; not on this pipeline stage
                targets[name] = target[0], Q8Weight if f.get_slice(key).get_dtype() == "I8" else Q4Weight
        formats: dict[str, set] = {}
        for weight, fmt in targets.values():
            formats.setdefault(weight, set()).add(fmt)
        # A fused Linear whose parts come in two formats keeps its bf16 weights.
        parts = {w: next(iter(f)).empty(*weights[w].shape) for w, f in formats.items() if len(f) == 1}
        rows: dict[str, int] = {}
        for key in f.keys():
            name, part = key.rsplit(".", 1)
            if name not in targets or targets[name][0] not in parts:
                continue
            weight, fmt = targets[name]
            target = model.checkpoint_target(name, {weight: getattr(parts[weight], part)})
            tensor, dest = _rank_slice(f.get_slice(key), part, model.checkpoint_slice(name), fmt), target[1]
            if tensor is None or tensor.shape != dest.shape:
                continue
            dest.copy_(tensor)
            if part == "qs":
                rows[weight] = rows.get(weight, 0) + dest.shape[0]
    attached = 0
    for name, mod in model.named_modules():
        w = f"{name}.weight"
        if w in parts and rows.get(w) == weights[w].shape[0]:
            mod.blocks = parts[w]
            attached += 1
    return attached
