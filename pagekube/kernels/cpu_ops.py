"""The CPU extension: the AVX-512 linears over bf16 weights (bf16_linear.cpp) and over a GGUF's Q4_1 and Q8_0 blocks
(gguf_linear.cpp), both adding up in one order at any row count (dot_order.h), the same linears on AMX tiles
(amx_linear.cpp), paged decode attention (paged_decode.cpp) and the decoder's fused small ops (fused_ops.cpp:
RMSNorm with the residual add, SiLU-and-mul, RoPE with the KV write). A second, smaller extension (int_linear.cpp) holds the quantized checkpoints' linear:
it needs only AVX2, so it is built apart.

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

# Without batch invariance (VLLM_BATCH_INVARIANT=0) and without AMX, torch's GEMM takes steps of more rows than this.
MAX_ROWS = 8
# Where AMX runs the linears: one kernel from one row to AMX_MAX_ROWS (faster than torch's GEMM up to about there,
# bench/cpu_linears.py), and past it torch's own AMX GEMM, which adds in the same order (docs/architecture.md).
AMX_MAX_ROWS = 1024
# Without batch invariance (VLLM_BATCH_INVARIANT=0) steps of up to this many rows take the AVX-512 kernels instead,
# faster there than AMX, which multiplies 16 rows at a time (bench/cpu_linears.py).
AVX512_ROWS_BEFORE_AMX = 4
SOURCES = [Path(__file__).parent / name
           for name in ("bf16_linear.cpp", "gguf_linear.cpp", "amx_linear.cpp", "paged_decode.cpp", "fused_ops.cpp")]
INT_SOURCES = [Path(__file__).parent / "int_linear.cpp"]
_state: dict[str, bool] = {}


def cpu_supports_bf16_dot() -> bool:
    return torch.cpu._is_avx512_bf16_supported()


def cpu_supports_amx() -> bool:
    return cpu_supports_bf16_dot() and torch.cpu._is_amx_tile_supported()


def batch_invariant() -> bool:
    """vLLM's switch, here on by default: VLLM_BATCH_INVARIANT=0 gives up batch invariance for speed, on AMX CPUs
    in steps of a few rows (the AVX-512 kernels up to AVX512_ROWS_BEFORE_AMX), on others in steps of more than
    MAX_ROWS (torch's GEMM: docs/operations.md)."""
    return os.environ.get("VLLM_BATCH_INVARIANT", "1") != "0"


def load_cpu_kernels() -> bool:
    """Build (once) and load the extension; False, with one warning in the log, where it cannot be had."""
    if "loaded" not in _state:
        _state["loaded"] = cpu_supports_bf16_dot() and _build(
            "pagekube_cpu", SOURCES, ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mf16c",
                                      "-mamx-tile", "-mamx-bf16"])
    return _state["loaded"]


def load_int_kernels() -> bool:
    """The quantized-weight linear (int_linear.cpp), for any CPU with AVX2 and FMA; False where it cannot be had."""
    if "int" not in _state:
        _state["int"] = torch.cpu._is_avx2_supported() and _build("pagekube_cpu_int", INT_SOURCES,
                                                                  ["-mavx2", "-mfma"])
    return _state["int"]


def _build(name: str, sources: list[Path], isa_flags: list[str]) -> bool:
    if os.environ.get("PAGEKUBE_CPU_KERNELS", "1") == "0":
        return False
    from torch.utils.cpp_extension import load

    try:  # the ninja wheel's binary, which cpp_extension looks for on PATH (the venv's bin is not always on it)
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    build_dir = build_directory() / ("" if name == "pagekube_cpu" else name)
    start = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        load(name, [str(p) for p in sources], build_directory=str(build_dir), is_python_module=False,
             # -fopenmp: at::parallel_for is inlined from torch's headers as `#pragma omp parallel`; without the
             # flag every kernel runs on one thread (it resolves to torch's own libgomp at load time).
             extra_cflags=["-O3", "-fopenmp", *isa_flags], extra_ldflags=["-fopenmp"])
    except Exception as err:  # no compiler (the engine images have none), a read-only home, an old toolchain
        log.warning({"msg": "CPU kernels unavailable; using torch's ops", "kernels": name,
                     "error": str(err)[-500:]})
        return False
    log.info({"msg": "CPU kernels ready", "kernels": name, "seconds": round(time.perf_counter() - start, 1)})
    return True


def build_directory() -> Path:
    """Where the extension is built and cached (pagekube_cpu.so), per torch version."""
    return Path.home() / ".cache" / "pagekube" / "torch_extensions" / f"torch-{torch.__version__}"


def loaded() -> bool:
    return _state.get("loaded", False)


def gguf_linear(x: torch.Tensor, blocks, bias: torch.Tensor | None = None, amx: bool = False) -> torch.Tensor:
    """x @ w.T (+ bias) with w in a GGUF's blocks (engine/model/layers/gguf_linears.py: Q4Weight, whose qs are
    uint8 nibbles, or Q8Weight, whose qs are int8); `amx`: on AMX tiles."""
    if blocks.qs.dtype == torch.int8:
        return torch.ops.pagekube_cpu.q8_0_linear(x, blocks.qs, blocks.d, bias, amx)
    return torch.ops.pagekube_cpu.q4_1_linear(x, blocks.qs, blocks.d, blocks.m, bias, amx)


@dataclass(frozen=True)
class CpuKernels:
    """The extension's kernels one model runs, chosen once when it loads (on the CPU in bf16 with the extension
    loaded: all of them; otherwise none; a benchmark may turn one off), so a layer's call checks only what varies
    per call: how many rows it has."""

    # The AVX-512 linears over bf16 weights and over a GGUF's Q4_1 and Q8_0 blocks (for Linears that have them): at
    # every row count where batch invariant (one order of addition whatever the step holds), else up to MAX_ROWS.
    linear: bool = False
    gguf_blocks: bool = False
    # Every linear (GGUF blocks or bf16) on AMX tiles at up to AMX_MAX_ROWS rows, in place of both: a row's result
    # then does not depend on how many rows its step has (batch invariance), at some cost in steps of one row.
    amx: bool = False
    batch_invariant: bool = True  # False: faster steps, whose rows' results depend on the rows beside them
    fused: bool = False  # RMSNorm with the residual add, SiLU-and-mul, RoPE with the KV write
    decode_attention: bool = False  # paged decode attention, reading K/V in place
    int_linear: bool = False  # a quantized checkpoint's int4/int8/FP8 Linears (int_linear.cpp: AVX2, any dtype)

    @classmethod
    def for_model(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> CpuKernels:
        on = loaded() and device.type == "cpu" and dtype == torch.bfloat16
        return cls(linear=on, gguf_blocks=on, amx=on and cpu_supports_amx(), batch_invariant=batch_invariant(), fused=on,
                   decode_attention=on and head_dim % 16 == 0 and head_dim <= 256,
                   int_linear=device.type == "cpu" and _state.get("int", False))

    @property
    def names(self) -> list[str]:
        """The kernels in use, for /version and pagekube:kernels_info ("batch_invariant" only where the linears make
        it so)."""
        return [name for name, on in vars(self).items() if on and (name != "batch_invariant" or self.linear)]

    def takes_linear(self, x: torch.Tensor) -> bool:
        if self.amx:
            return x.shape[0] <= AMX_MAX_ROWS
        return self.linear and (self.batch_invariant or x.shape[0] <= MAX_ROWS)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, blocks=None):
        """x @ weight.T (+ bias). With AMX: the GGUF blocks (when given) or the bf16 weights on AMX tiles up to
        AMX_MAX_ROWS, torch's AMX GEMM above (the same order of addition). Without: the blocks or the bf16 kernel at
        every row count (up to MAX_ROWS without batch invariance, torch above). The kernels over the blocks compute
        with the bf16 weights' exact values, in the bf16 kernels' order."""
        rows = x.shape[0]
        if self.amx and rows <= AMX_MAX_ROWS and (self.batch_invariant or rows > AVX512_ROWS_BEFORE_AMX):
            if blocks is not None:
                return gguf_linear(x, blocks, bias, amx=True)
            if weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0:
                return torch.ops.pagekube_cpu.bf16_amx_linear(x, weight, bias)
        if rows <= MAX_ROWS or (self.batch_invariant and not self.amx):
            if blocks is not None and self.gguf_blocks:
                return gguf_linear(x, blocks, bias)
            if self.linear:
                return torch.ops.pagekube_cpu.bf16_linear(x, weight, bias)
        return F.linear(x, weight, bias)


NO_KERNELS = CpuKernels()
