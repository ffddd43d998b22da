"""The CPU extension: the small-batch linears over bf16 weights (bf16_linear.cpp) and over GGUF Q4_1 blocks
(q4_linear.cpp), paged decode attention (paged_decode.cpp) and the decoder's fused small ops (fused_ops.cpp:
RMSNorm with the residual add, SiLU-and-mul, RoPE with the KV write).

Compiled on first use with torch.utils.cpp_extension into ~/.cache/pagekube/torch_extensions (about 15 s, once per
machine and torch version). Without a C++ compiler, without AVX512_BF16, or with PAGEKUBE_CPU_KERNELS=0 the engine
runs torch's own ops, which give the same results to bf16 rounding.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MAX_ROWS = 8  # measured crossover with torch's bf16 GEMM (docs/benchmarks.md): above it, torch is as fast or faster
# Measured crossover of the Q4_1 kernel with the bf16 one (bench/cpu_linears.py): it reads a third of the bytes, but
# unpacking and scaling each block costs arithmetic per row of x: 1.6x faster at one row, about even at two, slower
# from three up (docs/benchmarks.md).
Q4_MAX_ROWS = 2
SOURCES = [Path(__file__).parent / name
           for name in ("bf16_linear.cpp", "q4_linear.cpp", "paged_decode.cpp", "fused_ops.cpp")]
_state: dict[str, bool] = {}


def cpu_supports_bf16_dot() -> bool:
    return torch.cpu._is_avx512_bf16_supported()


def load_cpu_kernels() -> bool:
    """Build (once) and load the extension; False, with one warning in the log, where it cannot be had."""
    if "loaded" in _state:
        return _state["loaded"]
    _state["loaded"] = False
    if os.environ.get("PAGEKUBE_CPU_KERNELS", "1") == "0" or not cpu_supports_bf16_dot():
        return False
    from torch.utils.cpp_extension import load

    try:  # the ninja wheel's binary, which cpp_extension looks for on PATH (the venv's bin is not always on it)
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    build_dir = build_directory()
    start = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        load("pagekube_cpu", [str(p) for p in SOURCES], build_directory=str(build_dir), is_python_module=False,
             # -fopenmp: at::parallel_for is inlined from torch's headers as `#pragma omp parallel`; without the
             # flag every kernel runs on one thread (it resolves to torch's own libgomp at load time).
             extra_cflags=["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mf16c"],
             extra_ldflags=["-fopenmp"])
    except Exception as err:  # no compiler (the engine images have none), a read-only home, an old toolchain
        log.warning({"msg": "CPU kernels unavailable; using torch's ops", "error": str(err)[-500:]})
        return False
    log.info({"msg": "CPU kernels ready", "seconds": round(time.perf_counter() - start, 1)})
    _state["loaded"] = True
    return True


def build_directory() -> Path:
    """Where the extension is built and cached (pagekube_cpu.so), per torch version."""
    return Path.home() / ".cache" / "pagekube" / "torch_extensions" / f"torch-{torch.__version__}"


def loaded() -> bool:
    return _state.get("loaded", False)


def uses_bf16_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (loaded() and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.device.type == "cpu"
            and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16)


def uses_q4_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # The row count first: above it (most steps of a busy server) linear() makes the other checks anyway.
    return x.dim() == 2 and x.shape[0] <= Q4_MAX_ROWS and uses_bf16_kernel(x, weight)


def q4_linear(x: torch.Tensor, q4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) with w in Q4_1 blocks (engine/gguf_linears.Q4Weight); callers check uses_q4_kernel."""
    return torch.ops.pagekube_cpu.q4_1_linear(x, q4.qs, q4.d, q4.m, bias)


def uses_decode_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    head_dim = q.shape[-1]
    return (loaded() and q.device.type == "cpu" and q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16
            and head_dim % 16 == 0 and head_dim <= 256)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if uses_bf16_kernel(x, weight):
        return torch.ops.pagekube_cpu.bf16_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def uses_fused_ops(x: torch.Tensor) -> bool:
    """Whether the fused small ops apply to a bf16 CPU activation (engine/model/model.py has their torch equivalents)."""
    return loaded() and x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.is_contiguous()
