"""The memory-bandwidth floor of one user's decode step: how fast this machine reads memory, and how long reading
the bundled model's weights once then takes at the least.

    .venv/bin/python bench/stream_read.py            # a 1 GiB buffer, best of 5 reads per thread count
    .venv/bin/python bench/stream_read.py --smoke    # tiny sizes: the script still runs (tests/test_bench_smoke.py)

A decode step at batch 1 reads every linear weight once; nothing it does can beat bytes / bandwidth. The read is
torch's sum over a float32 buffer much larger than the caches (a streaming read, as the linear kernels' weights
are), with 1 thread and with every core.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from pagekube.engine.model.model_files import bundled_model_file, convert_gguf


def read_bandwidth(buffer: torch.Tensor, threads: int, reps: int) -> float:
    """Bytes per second of the best of `reps` full reads."""
    torch.set_num_threads(threads)
    buffer.sum()  # touch every page once
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1024, help="buffer size")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.mib, args.reps = 64, 1
    buffer = torch.ones(args.mib * 1024 * 1024 // 4, dtype=torch.float32)
    cores = os.cpu_count() or 1
    rates = {t: read_bandwidth(buffer, t, args.reps) for t in sorted({1, cores})}
    gguf = bundled_model_file()
    weights = {"Q4_1 GGUF (the AVX-512 kernels' weights)": gguf.stat().st_size,
               "float32 safetensors (the AVX2 path's weights)": (convert_gguf(gguf) / "model.safetensors").stat().st_size}
    print(f"streaming read of {args.mib} MiB, best of {args.reps}")
    print("| threads | GB/s |\n|---|---|")
    for t, rate in rates.items():
        print(f"| {t} | {rate / 1e9:.1f} |")
    print("\n| weights read per step | MB | floor at 1 thread | floor at all cores |\n|---|---|---|---|")
    for name, size in weights.items():
        print(f"| {name} | {size / 1e6:.1f} | {1000 * size / rates[1]:.1f} ms | {1000 * size / rates[cores]:.1f} ms |")


if __name__ == "__main__":
    main()
