"""Triton kernels vs their torch reference and a float64 reference, under TRITON_INTERPRET=1 on the CPU.

Outputs are poisoned with NaN before each launch, so every element must be written; inputs are fresh random
numbers for every case.
"""

from __future__ import annotations

import zlib

import pytest
import torch

# TRITON_INTERPRET=1 is set by conftest.py where there is no GPU
from pagekube.kernels import triton_attention as ta
from pagekube.kernels.reference import paged_attention_ref, write_kv_cache_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
CASES = [(gqa, dim, bs) for gqa in (1, 3, 8) for dim in (64, 128) for bs in (16, 32)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_cache(num_blocks, bs, kv_heads, dim, dtype, gen):
    k = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    return k, v


def tables_for(ctx_lens, bs, num_blocks, gen):
    width = max(-(-c // bs) for c in ctx_lens)
    perm = torch.randperm(num_blocks, generator=gen)  # each sequence gets distinct, shuffled physical blocks
    rows, used = [], 0
    for c in ctx_lens:
        n = -(-c // bs)
        row = torch.zeros(width, dtype=torch.int32)
        row[:n] = perm[used : used + n]
        used += n
        rows.append(row)
    return torch.stack(rows).to(DEVICE)


def make_case(tag: str, gqa: int, dim: int, bs: int, dtype, ctx: list[int], spare_blocks: int):
    """Fresh random caches and shuffled block tables for sequences of `ctx` tokens; returns (gen, heads, k, v, tables)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{tag}{gqa}-{dim}-{bs}-{dtype}".encode()))
    kv_heads = 2 if gqa < 8 else 1
    num_blocks = sum(-(-c // bs) for c in ctx) + spare_blocks
    k_cache, v_cache = make_cache(num_blocks, bs, kv_heads, dim, dtype, gen)
    return gen, kv_heads * gqa, k_cache, v_cache, tables_for(ctx, bs, num_blocks, gen)


def context_lengths(bs):
    return [1, bs - 1, bs, bs + 1, 2 * bs - 1, 2 * bs + 1, 5 * bs + 3]  # 1, block boundaries +/- 1, ragged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("gqa,dim,bs", CASES)
def test_decode_attention(gqa, dim, bs, dtype):
    ctx = context_lengths(bs)
    gen, heads, k_cache, v_cache, tables = make_case("d", gqa, dim, bs, dtype, ctx, spare_blocks=3)
    q = torch.randn(len(ctx), heads, dim, generator=gen).to(dtype).to(DEVICE)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    scale = dim**-0.5
    ref = paged_attention_ref(q, k_cache, v_cache, tables, list(range(len(ctx) + 1)), ctx, scale)
    ref64 = paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, list(range(len(ctx) + 1)), ctx, scale)
    for splits in (1, 3):  # single pass and the split-K (flash-decoding) path
        out = torch.full_like(q, float("nan"))
        ta.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=splits, out=out)
        assert not out.isnan().any(), "every output element must be written"
        assert rel_err(out, ref64) < TOL[dtype]
        assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("gqa,dim,bs", CASES)
def test_prefill_attention_over_cached_prefix(gqa, dim, bs, dtype):
    # (new query tokens, context after this step): whole prompts, chunks over a cached prefix, single tokens
    shapes = [(1, 1), (bs + 1, bs + 1), (5, 2 * bs + 3), (bs, 3 * bs), (20, 20), (1, bs + 1)]
    qlens = [n for n, _ in shapes]
    ctx = [c for _, c in shapes]
    gen, heads, k_cache, v_cache, tables = make_case("p", gqa, dim, bs, dtype, ctx, spare_blocks=2)
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads, dim, generator=gen).to(dtype).to(DEVICE)
    scale = dim**-0.5
    ref = paged_attention_ref(q, k_cache, v_cache, tables, starts, ctx, scale)
    ref64 = paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, starts, ctx, scale)
    out = torch.full_like(q, float("nan"))
    ta.paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                               torch.tensor(ctx, dtype=torch.int32, device=DEVICE), max(qlens), scale, out=out)
    assert not out.isnan().any(), "every output element must be written"
    assert rel_err(out, ref64) < TOL[dtype]
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kv_heads,dim,bs", [(1, 64, 16), (2, 128, 32), (8, 64, 16)])
def test_write_kv_cache_matches_reference_and_skips_minus_one(kv_heads, dim, bs, dtype):
    gen = torch.Generator().manual_seed(kv_heads * dim + bs)
    k_cache, v_cache = make_cache(6, bs, kv_heads, dim, dtype, gen)
    k = torch.randn(9, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(9, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.tensor([0, 5, -1, bs - 1, bs, 3 * bs + 2, -1, 6 * bs - 1, 2 * bs], device=DEVICE)
    ours_k, ours_v, ref_k, ref_v = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    ta.write_kv_cache(k, v, ours_k, ours_v, slots)
    write_kv_cache_ref(k, v, ref_k, ref_v, slots)
    assert torch.equal(ours_k, ref_k) and torch.equal(ours_v, ref_v)
    assert not torch.equal(ours_k, k_cache)  # it did write


def test_engine_with_triton_backend_matches_torch_backend(bundled_dir):
    from pagekube.engine import SamplingParams
    from pagekube.engine.config import EngineConfig
    from pagekube.engine.llm_engine import LLMEngine

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(EngineConfig(model=str(bundled_dir), attention_backend=backend,
                                        kv_cache_memory=16 * 1024**2))
        assert engine.runner.backend.name == backend
        engine.add_request("r", "The capital of France is", params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[backend] = out.outputs[0].token_ids
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_mixed_step_sends_decode_rows_to_the_decode_kernel(dtype, monkeypatch):
    """Decode rows interleaved with prefill chunks: the backend splits them (the prefill kernel sees only the
    chunks), and the result is the reference's."""
    from pagekube.engine.model.attention import TritonAttention
    from pagekube.engine.model.model import AttentionMetadata

    bs, dim, gqa = 16, 64, 3
    shapes = [(1, 40), (bs + 1, bs + 1), (1, 3), (1, 2 * bs + 1), (5, 2 * bs + 3), (1, 17)]
    qlens, ctx = [n for n, _ in shapes], [c for _, c in shapes]
    gen, heads, k_cache, v_cache, tables = make_case("m", gqa, dim, bs, dtype, ctx, spare_blocks=2)
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads, dim, generator=gen).to(dtype).to(DEVICE)
    meta = AttentionMetadata(slot_mapping=torch.empty(0), block_tables=tables,
                             query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                             context_lens=torch.tensor(ctx, dtype=torch.int32, device=DEVICE), query_lens=qlens,
                             context_lens_list=ctx)
    prefill_batches = []
    real_prefill = ta.paged_prefill_attention

    def spy(q, k_cache, v_cache, block_tables, *args, **kw):
        prefill_batches.append(block_tables.shape[0])
        return real_prefill(q, k_cache, v_cache, block_tables, *args, **kw)
    monkeypatch.setattr(ta, "paged_prefill_attention", spy)
    out = TritonAttention().attend(q, k_cache, v_cache, meta, dim**-0.5)
    assert prefill_batches == [2]  # the two chunks only
    ref64 = paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, starts, ctx, dim**-0.5)
    assert rel_err(out, ref64) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_shrink_expand_matches_reference_over_mixed_segments(dtype):
    """Segments of different lengths (one longer than a row block), two of them on one slot, base rows between
    them untouched; widths not a power of two and output columns past one column block."""
    from pagekube.kernels.reference import lora_shrink_expand_ref
    from pagekube.kernels.triton_lora import lora_shrink_expand

    gen = torch.Generator().manual_seed(3)
    tokens, k, n, width, slots = 41, 96, 150, 24, 3
    x = torch.randn(tokens, k, generator=gen).to(dtype).to(DEVICE)
    y = torch.randn(tokens, n, generator=gen).to(dtype).to(DEVICE)
    a = torch.randn(slots, width, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(slots, n, width, generator=gen).to(dtype).to(DEVICE)
    segments = torch.tensor([[0, 3, 2], [5, 20, 0], [25, 1, 2], [30, 11, 1]], dtype=torch.int32, device=DEVICE)
    ref = lora_shrink_expand_ref(x, y.clone(), a, b, segments)
    out = lora_shrink_expand(x, y.clone(), a, b, segments, max_segment=20)
    assert torch.equal(out[3:5], y[3:5]) and torch.equal(out[26:30], y[26:30])  # base rows: as they were
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(out - y, ref - y) < TOL[dtype] * 4  # the LoRA term itself, not only the sum


def _int_weight(gen, n, k, bits, group, zero=True, act_order=False):
    from pagekube.engine.quantization.layouts import pack_nibbles
    from pagekube.engine.quantization.packed import IntWeight

    groups = k // group
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    zp = (torch.randint(0, 2**bits, (n, groups), generator=gen) if zero
          else torch.full((n, groups), 2 ** (bits - 1))).to(torch.uint8)
    scale = torch.rand(n, groups, generator=gen) * 0.02 + 0.001
    g_idx = torch.randperm(k, generator=gen) // group if act_order else None  # columns of a group scattered
    packed = pack_nibbles(q) if bits == 4 else q
    return IntWeight(packed.to(DEVICE), scale.to(DEVICE), zp.to(DEVICE), bits, group,
                     None if g_idx is None else g_idx.to(DEVICE))


def _fp8_weight(gen, n, k, block):
    from pagekube.engine.quantization.packed import Fp8Weight

    codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    codes[0, :254] = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # every value
    codes[codes & 0x7F == 0x7F] = 0x38  # no NaN codes (1.0 instead)
    shape = (1, 1) if block is None else (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(*shape, generator=gen) + 0.5
    return Fp8Weight(codes.view(torch.float8_e4m3fn).to(DEVICE), scale.to(DEVICE), block)


QUANT_CASES = {
    "int4-asym-g32": lambda g: _int_weight(g, 150, 320, 4, 32),
    "int4-sym-g64": lambda g: _int_weight(g, 150, 320, 4, 64, zero=False),
    "int4-act-order": lambda g: _int_weight(g, 150, 320, 4, 32, act_order=True),
    "int8-per-channel": lambda g: _int_weight(g, 150, 320, 8, 320, zero=False),
    "fp8-per-tensor": lambda g: _fp8_weight(g, 150, 320, None),
    "fp8-blocks": lambda g: _fp8_weight(g, 150, 320, (64, 32)),
}


@pytest.mark.parametrize("case", QUANT_CASES)
def test_quantized_gemm_dequantizes_each_weight_exactly(case):
    """x = the identity: each output is one weight, so the kernel's dequantization equals packed.py's bit for bit
    (every FP8 code, subnormals included; scattered act-order groups; ragged tiles)."""
    from pagekube.engine.quantization.packed import QuantizedWeight

    weight = QUANT_CASES[case](torch.Generator().manual_seed(zlib.crc32(case.encode())))
    eye = torch.eye(weight.shape[1], dtype=torch.float32, device=DEVICE)
    out = QuantizedWeight([weight]).triton_linear(eye)
    assert torch.equal(out, weight.dequantize(torch.float32).T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, 33, 70])
@pytest.mark.parametrize("case", QUANT_CASES)
def test_quantized_gemm_matches_dequantize_then_matmul(case, rows, dtype):
    """The GPU's W4A16 / W8A16 / FP8 path against the torch path (dequantize to the dtype, then F.linear), for a
    fused Linear of two projections with their own scales, at row counts on and off the row tiles."""
    from pagekube.engine.quantization.packed import QuantizedWeight

    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}{rows}".encode()))
    weight = QuantizedWeight([QUANT_CASES[case](gen), QUANT_CASES[case](gen)])
    x = torch.randn(rows, weight.shape[1], generator=gen).to(dtype).to(DEVICE)
    out = weight.triton_linear(x)
    ref = torch.nn.functional.linear(x, weight.dequantize(dtype))
    assert out.shape == (rows, weight.shape[0]) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]
