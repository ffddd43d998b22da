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
from dataclasses import dataclass
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


def q4_linear(x: torch.Tensor, q4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) with w in Q4_1 blocks (engine/model/layers/gguf_linears.Q4Weight)."""
    return torch.ops.pagekube_cpu.q4_1_linear(x, q4.qs, q4.d, q4.m, bias)


@dataclass(frozen=True)
class CpuKernels:
    """The extension's kernels one model runs, chosen once when it loads (on the CPU in bf16 with the extension
    loaded: all of them; otherwise none; a benchmark may turn one off), so a layer's call checks only what varies
    per call: how many rows it has."""

    linear: bool = False  # bf16 linears at up to MAX_ROWS rows
    q4: bool = False  # a GGUF's Q4_1 blocks at up to Q4_MAX_ROWS rows, for Linears that have them
    fused: bool = False  # RMSNorm with the residual add, SiLU-and-mul, RoPE with the KV write
    decode_attention: bool = False  # paged decode attention, reading K/V in place

    @classmethod
    def for_model(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> CpuKernels:
        on = loaded() and device.type == "cpu" and dtype == torch.bfloat16
        return cls(linear=on, q4=on, fused=on, decode_attention=on and head_dim % 16 == 0 and head_dim <= 256)

    @property
    def names(self) -> list[str]:
        return [name for name, on in vars(self).items() if on]

    def takes_linear(self, x: torch.Tensor) -> bool:
        return self.linear and x.shape[0] <= MAX_ROWS

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, q4=None):
        """x @ weight.T (+ bias): the Q4_1 blocks at one or two rows (when given), the bf16 kernel up to
        MAX_ROWS, torch above (measured crossovers, docs/benchmarks.md)."""
        rows = x.shape[0]
        if q4 is not None and self.q4 and rows <= Q4_MAX_ROWS:
            return q4_linear(x, q4, bias)
        if self.linear and rows <= MAX_ROWS:
            return torch.ops.pagekube_cpu.bf16_linear(x, weight, bias)
        return F.linear(x, weight, bias)


NO_KERNELS = CpuKernels()
