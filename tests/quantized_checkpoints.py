"""Quantized checkpoints for the tests.

- Made by llm-compressor, as users make them: it pins transformers and compressed-tensors apart from the project,
  so it runs from its own virtualenv, created once under the cache (as bench/build_llama_server.sh caches its
  build), by tests/llmcompressor_oneshot.py. Checkpoints are cached by recipe and base-model content.
- AWQ and GPTQ checkpoints converted from a compressed-tensors one (the same integers, packed the way AutoAWQ and
  GPTQ pack them: written here from their formats, not with the engine's code), so each must give its output.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pagekube.engine.model.model_files import cache_root

LLMCOMPRESSOR = "llmcompressor==0.14.0.1"
TORCH = "torch==2.13.0"  # the build this machine keeps (the project's own pin in scripts/setup.sh)
ONESHOT = Path(__file__).parent / "llmcompressor_oneshot.py"
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of each word holds column AWQ_PACK_ORDER[i]


def int_weights(bits: int, group_size: int | None, symmetric: bool = True) -> dict:
    """A compressed-tensors config group's weights: int `bits`, per group (or per channel), round-to-nearest."""
    strategy = {"strategy": "group", "group_size": group_size} if group_size else {"strategy": "channel"}
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, **strategy}


# The bundled model's checkpoints (tests/test_quantized.py, bench/quantized.py): name -> llm-compressor job.
# SmolLM2's 576 columns do not divide by 128 (llm-compressor's W4A16 preset), hence groups of 64 and 32.
SMOLLM_JOBS = {
    "w4a16-g64": {"weights": int_weights(4, 64)},
    "w4a16-g32-asym": {"weights": int_weights(4, 32, symmetric=False)},
    "w8a16-channel": {"weights": int_weights(8, None)},
    "fp8-dynamic": {"scheme": "FP8_DYNAMIC"},
    "w4a16-g64-gptq-act-order": {"gptq": {**int_weights(4, 64), "actorder": "weight"}},
}


def llmcompressor_python() -> Path:
    """llm-compressor's virtualenv (made once per machine, ~1 min from pip's cache), its python."""
    venv = cache_root() / "llmcompressor-venv"
    ready = venv / ".ready"
    if ready.exists():
        return venv / "bin" / "python"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / "llmcompressor-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
            subprocess.run([*pip, TORCH], check=True)
            subprocess.run([*pip, LLMCOMPRESSOR, TORCH], check=True)
            ready.touch()
    return venv / "bin" / "python"


def _content_key(base: Path, job: dict) -> str:
    h = hashlib.sha256(f"{LLMCOMPRESSOR}:{json.dumps(job, sort_keys=True)}".encode())
    for f in sorted(base.glob("*.safetensors")) + [base / "config.json"]:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def quantize(base: Path, jobs: dict[str, dict]) -> dict[str, Path]:
    """Each job (name -> llmcompressor_oneshot.py job) applied to `base`, in one llm-compressor run for all those
    not cached yet; name -> checkpoint directory."""
    out = {name: cache_root() / "quantized" / f"{name}-{_content_key(base, job)}"  # content, not folder names
           for name, job in jobs.items()}
    todo = [{**jobs[name], "out": str(path)} for name, path in out.items() if not path.exists()]
    if todo:
        out[next(iter(out))].parent.mkdir(parents=True, exist_ok=True)
        for job in todo:
            shutil.rmtree(job["out"] + ".tmp", ignore_errors=True)
        subprocess.run([str(llmcompressor_python()), str(ONESHOT), str(base), json.dumps(todo)], check=True,
                       stdout=subprocess.DEVNULL)
    return out


# ---- AWQ and GPTQ layouts, packed from known integers -------------------------------------------------------


def _to_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing: uint values [rows, cols] -> int32 [rows, cols/8] along the columns."""
    q = q.numpy().astype(np.uint64).reshape(q.shape[0], -1, 8)
    words = sum(q[:, :, col] << (4 * i) for i, col in enumerate(AWQ_PACK_ORDER))
    return _to_int32(words)


def pack_along_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qweight packing: uint values [rows, cols] -> int32 [rows*bits/32, cols], row 8w+i at bit i*bits."""
    per = 32 // bits
    q = q.numpy().astype(np.uint64).reshape(-1, per, q.shape[1])
    return _to_int32(sum(q[:, i] << (bits * i) for i in range(per)))


def pack_along_cols(q: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qzeros packing: uint values [rows, cols] -> int32 [rows, cols*bits/32], column 8w+i at bit i*bits."""
    return pack_along_rows(q.t().contiguous(), bits).t().contiguous()


def _ct_integers(tensors: dict, base: str, bits: int, symmetric: bool):
    """A compressed-tensors projection's unsigned q [N, K], zero points [N, groups] and scales, decoded with
    compressed-tensors' own unpacking."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    shape = tuple(tensors[f"{base}.weight_shape"].tolist())
    offset = 1 << (bits - 1)
    q = unpack_from_int32(tensors[f"{base}.weight_packed"], bits, shape).to(torch.int32) + offset
    scale = tensors[f"{base}.weight_scale"]
    if symmetric:
        zero = torch.full(scale.shape, offset, dtype=torch.int32)
    else:
        zero = unpack_from_int32(tensors[f"{base}.weight_zero_point"], bits, scale.shape, packed_dim=0)
        zero = zero.to(torch.int32) + offset
    return q.to(torch.uint8), zero.to(torch.uint8), scale


def convert(ct_dir: Path, out: Path, layout: str, seed: int = 0) -> Path:
    """A compressed-tensors W4A16 group checkpoint rewritten as `layout`: awq, gptq, or gptq-act-order (the groups
    renumbered by a random permutation, so g_idx is not in column order: the same weights, desc_act's layout)."""
    config = json.loads((ct_dir / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    bits, group, symmetric = weights["num_bits"], weights["group_size"], weights["symmetric"]
    tensors = load_file(ct_dir / "model.safetensors")
    converted, gen = {}, torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        base = name.removesuffix(".weight_packed")
        q, zero, scale = _ct_integers(tensors, base, bits, symmetric)
        n, k = q.shape
        if layout == "awq":
            converted |= {f"{base}.qweight": pack_awq(q.t().contiguous()), f"{base}.qzeros": pack_awq(zero.t()),
                          f"{base}.scales": scale.t().contiguous()}
            continue
        g_idx = torch.arange(k, dtype=torch.int32) // group
        if layout == "gptq-act-order":
            perm = torch.randperm(scale.shape[1], generator=gen)
            g_idx = perm[g_idx.long()].to(torch.int32)
            scale = torch.empty_like(scale).index_copy_(1, perm, scale)
            zero = torch.empty_like(zero).index_copy_(1, perm, zero)
        converted |= {f"{base}.qweight": pack_along_rows(q.t().contiguous(), bits),
                      # v1 stores zero - 1 (a zero point of 0 wraps to 2^bits - 1 there, as in GPTQ itself)
                      f"{base}.qzeros": pack_along_cols(((zero.to(torch.int32) - 1) & (1 << bits) - 1).t(), bits),
                      f"{base}.scales": scale.t().contiguous(), f"{base}.g_idx": g_idx}
    rest = {n: t for n, t in tensors.items() if not n.rsplit(".", 1)[-1].startswith("weight_")}
    out.mkdir(parents=True, exist_ok=True)
    save_file(rest | converted, out / "model.safetensors", metadata={"format": "pt"})
    if layout == "awq":
        qc = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": not symmetric,
              "version": "gemm", "modules_to_not_convert": None}
    else:
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": symmetric,
              "desc_act": layout == "gptq-act-order", "checkpoint_format": "gptq"}
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in ct_dir.iterdir():
        if f.name.startswith(("tokenizer", "generation_config", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out
