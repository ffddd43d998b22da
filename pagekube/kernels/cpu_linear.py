"""Linear layers on CPUs: the small-batch bf16 kernel (bf16_linear.cpp) where it is faster, F.linear elsewhere.

The kernel is compiled on first use with torch.utils.cpp_extension into ~/.cache/pagekube/torch_extensions (about
10 s, once per machine and torch version). Without a C++ compiler, without AVX512_BF16, or with
PAGEKUBE_CPU_KERNELS=0 the engine runs torch's own linear, which gives the same results to bf16 rounding.
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
SOURCE = Path(__file__).parent / "bf16_linear.cpp"
_state: dict[str, bool] = {}


def cpu_supports_bf16_dot() -> bool:
    return torch.cpu._is_avx512_bf16_supported()


def load_bf16_kernel() -> bool:
    """Build (once) and load the kernel; False, with one warning in the log, where it cannot be had."""
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
    build_dir = Path.home() / ".cache" / "pagekube" / "torch_extensions" / f"torch-{torch.__version__}"
    start = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        load("pagekube_bf16_linear", [str(SOURCE)], build_directory=str(build_dir), is_python_module=False,
             extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16"])
    except Exception as err:  # no compiler (the engine images have none), a read-only home, an old toolchain
        log.warning({"msg": "CPU bf16 linear kernel unavailable; using torch's", "error": str(err)[-500:]})
        return False
    log.info({"msg": "CPU bf16 linear kernel ready", "seconds": round(time.perf_counter() - start, 1)})
    _state["loaded"] = True
    return True


def uses_bf16_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_state.get("loaded", False) and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.device.type == "cpu"
            and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if uses_bf16_kernel(x, weight):
        return torch.ops.pagekube_cpu.bf16_linear(x, weight, bias)
    return F.linear(x, weight, bias)
