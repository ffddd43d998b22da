"""GPU quantized GEMM benchmark: the Triton kernel (pagekube/kernels/triton_quant.py) on W4A16 / W8A16 / FP8
weights against torch's bf16 GEMM on the same shapes, checked against dequantize-then-matmul first.

    python bench/gpu_quant.py            # needs CUDA; prints a markdown table for docs/benchmarks.md

Llama-8B-like projections (q/o 4096x4096, gate/up 28672x4096 fused, down 4096x14336), bf16 activations, groups
of 128, at 1 / 16 / 64 / 256 rows. CUDA events, median of 50 runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_kernels import time_ms  # noqa: E402

SHAPES = {"q/o 4096x4096": (4096, 4096), "gate/up 28672x4096": (28672, 4096), "down 4096x14336": (4096, 14336)}


def weights(n: int, k: int):
    from pagekube.engine.quantization.layouts import pack_nibbles
    from pagekube.engine.quantization.packed import Fp8Weight, IntWeight, QuantizedWeight

    def ints(bits, group):
        q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, device="cuda")
        zero = torch.full((n, k // group), 2 ** (bits - 1), dtype=torch.uint8, device="cuda")
        scale = torch.rand(n, k // group, device="cuda") * 0.01
        return QuantizedWeight([IntWeight(pack_nibbles(q) if bits == 4 else q, scale, zero, bits, group)])

    fp8 = (torch.randn(n, k, device="cuda") * 0.1).to(torch.float8_e4m3fn)
    return {"W4A16 g128": ints(4, 128), "W8A16 channel": ints(8, k),
            "FP8 channel": QuantizedWeight([Fp8Weight(fp8, torch.rand(n, 1, device="cuda") * 0.01)])}


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}\n")
    print("| projection | rows | bf16 GEMM (us) | W4A16 g128 (us) | W8A16 channel (us) | FP8 channel (us) |")
    print("|---|---|---|---|---|---|")
    for label, (n, k) in SHAPES.items():
        bench_shape(label, n, k)
        torch.cuda.empty_cache()


def bench_shape(label: str, n: int, k: int) -> None:
    quant = weights(n, k)
    dense = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    for rows in (1, 16, 64, 256):
        x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        cells = [time_ms(lambda x=x: torch.nn.functional.linear(x, dense)) * 1e3]
        for w in quant.values():
            ref = torch.nn.functional.linear(x, w.dequantize(torch.bfloat16)).float()
            err = ((w.triton_linear(x).float() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, f"{label} rows {rows}: relative error {err}"
            cells.append(time_ms(lambda w=w, x=x: w.triton_linear(x)) * 1e3)
        print(f"| {label} | {rows} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")

if __name__ == "__main__":
    main()
