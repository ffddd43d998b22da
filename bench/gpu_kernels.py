"""GPU kernel benchmark: correctness first, then decode attention timing vs torch SDPA and the bandwidth floor.

    python bench/gpu_kernels.py            # needs CUDA; prints a markdown table for docs/benchmarks.md

Llama-8B-like heads (32 query heads, 8 KV heads, head dim 128), bf16, block size 16. Each row: batch, context,
our paged decode kernel, torch SDPA over K/V already gathered into dense tensors (a lower bound for a gather +
SDPA implementation), the floor = bytes of K/V read / measured device copy bandwidth, and the fraction of copy
bandwidth the kernel reaches. CUDA events, median of many runs.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS, KV_HEADS, DIM, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16


def time_ms(fn, iters: int = 50, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() / (ms / 1e3)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth: {bw / 1e9:.0f} GB/s\n")
    print("| batch | context | pagekube decode (us) | SDPA on gathered K/V (us) | floor (us) | % of copy bandwidth |")
    print("|---|---|---|---|---|---|")
    for batch in (1, 8, 32, 64, 128, 256):
        for ctx in (512, 2048, 4096, 8192, 16384, 32768):
            if 2 * batch * ctx * KV_HEADS * DIM * 2 <= 60e9:
                print(bench_case(batch, ctx, bw))
                torch.cuda.empty_cache()


def bench_case(batch: int, ctx: int, bw: float) -> str:
    from pagekube.kernels import triton_attention as ta
    from pagekube.kernels.reference import paged_attention_ref

    blocks_per_seq = ctx // BS
    num_blocks = batch * blocks_per_seq
    kv_bytes = 2 * num_blocks * BS * KV_HEADS * DIM * 2
    k_cache = torch.randn(num_blocks, BS, KV_HEADS, DIM, dtype=DTYPE, device="cuda")
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device="cuda").int().view(batch, blocks_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, DIM, dtype=DTYPE, device="cuda")
    scale = DIM**-0.5
    out = ta.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    if batch <= 8 and ctx <= 4096:  # correctness against the torch reference before timing
        ref = paged_attention_ref(q, k_cache, v_cache, tables, list(range(batch + 1)), [ctx] * batch, scale)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 1e-2, f"batch {batch} ctx {ctx}: relative error {err}"
    ours = time_ms(lambda: ta.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale))
    k_dense = k_cache[tables.long()].flatten(1, 2).transpose(1, 2)  # [batch, kv_heads, ctx, dim]
    v_dense = v_cache[tables.long()].flatten(1, 2).transpose(1, 2)
    qd = q[:, :, None, :]
    sdpa = time_ms(lambda: F.scaled_dot_product_attention(qd, k_dense, v_dense, scale=scale, enable_gqa=True))
    floor = kv_bytes / (bw / 2) * 1e3  # reads only: half of a copy's traffic per byte
    return (f"| {batch} | {ctx} | {ours * 1e3:.0f} | {sdpa * 1e3:.0f} | {floor * 1e3:.0f} | "
            f"{100 * floor / ours:.0f}% |")

if __name__ == "__main__":
    main()
