"""The CPU extension against its references: the bf16 linear vs float32 linear, and each of its rows the same whatever
the rows beside it; paged decode attention and the fused small ops (RMSNorm, SiLU-and-mul, RoPE with the cache write)
vs the torch path the engine runs without them."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from pagekube.engine.model.model import RMSNorm, rotate_half
from pagekube.kernels import cpu_ops
from pagekube.kernels.reference import paged_attention_ref, write_kv_cache_ref

pytestmark = pytest.mark.skipif(not cpu_ops.cpu_supports_bf16_dot(), reason="this CPU has no AVX512_BF16")


@pytest.fixture(scope="module")
def kernel():
    assert shutil.which("g++") or shutil.which("c++"), "scripts/test-deps.sh installs g++"
    assert cpu_ops.load_cpu_kernels(), "the kernel should build where the CPU and a compiler allow it"
    return torch.ops.pagekube_cpu.bf16_linear


def reference(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def test_kernels_run_on_torchs_threads(kernel):
    """at::parallel_for is inlined from torch's headers as `#pragma omp parallel`: built without -fopenmp, every
    kernel silently runs on one thread (a decode step took 33 instead of 22 ms). The built library must call the
    OpenMP runtime."""
    library = (cpu_ops.build_directory() / "pagekube_cpu.so").read_bytes()
    assert b"GOMP_parallel" in library and b"libgomp.so" in library


# every streamed block size; past 8 the tiles: 3 rows and a remainder of 1 or 2
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 9, 17, 34, 200])
@pytest.mark.parametrize("k", [32, 100, 576])  # a full vector, a masked tail, the bundled model's hidden size
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float32_linear(kernel, rows, k, with_bias):
    torch.manual_seed(rows * 1000 + k)
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(67, k).bfloat16()
    b = torch.randn(67).bfloat16() if with_bias else None
    got, want = kernel(x, w, b), reference(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 67)
    # float accumulation in another order, then one rounding to bf16 (8 bits of mantissa)
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-3 * k)


def test_non_contiguous_input(kernel):
    x = torch.randn(64, 4).bfloat16().t()  # [4, 64], strided
    w = torch.randn(16, 64).bfloat16()
    torch.testing.assert_close(kernel(x, w, None).float(), reference(x, w, None), rtol=2**-7, atol=0.1)


def test_rejects_other_dtypes(kernel):
    with pytest.raises(RuntimeError, match="bf16 only"):
        kernel(torch.randn(1, 32), torch.randn(8, 32), None)


@pytest.mark.parametrize("k", [32, 100, 576, 1536])
@pytest.mark.parametrize("n", [67, 96])  # weight groups of 16 and a remainder; tiles of 4 weight rows and of 3
def test_no_row_depends_on_the_rows_beside_it(kernel, k, n):
    """Streamed (up to 8 rows) or tiled (past 8), every output is added up in one order (dot_order.h): a row alone,
    at the head or the tail of a batch, and in a batch of 300 gives the same bits."""
    torch.manual_seed(k + n)
    x, w, b = torch.randn(300, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    everything = kernel(x, w, b)
    for rows in (1, 2, 8, 9, 10, 11, 33, 193):  # at K=1536, 193 rows take two passes over the weights (168 + 25)
        assert torch.equal(kernel(x[:rows], w, b), everything[:rows]), rows
        assert torch.equal(kernel(x[-rows:], w, b), everything[-rows:]), rows


def test_linear_takes_the_kernel_at_every_row_count_unless_batch_invariance_is_off(kernel):
    w = torch.randn(40, 96).bfloat16()
    small, large = torch.randn(cpu_ops.MAX_ROWS, 96).bfloat16(), torch.randn(cpu_ops.MAX_ROWS + 1, 96).bfloat16()
    kernels = cpu_ops.CpuKernels(linear=True, gguf_blocks=True, fused=True, decode_attention=True)  # a CPU without AMX
    assert kernels.takes_linear(small) and kernels.takes_linear(large)
    assert torch.equal(kernels.matmul(large, w), kernel(large, w, None))
    fast = cpu_ops.CpuKernels(linear=True, gguf_blocks=True, batch_invariant=False)  # VLLM_BATCH_INVARIANT=0
    assert fast.takes_linear(small) and not fast.takes_linear(large)
    assert torch.equal(fast.matmul(small, w), kernel(small, w, None))
    assert torch.equal(fast.matmul(large, w), F.linear(large, w))
    # Chosen once per model: float32 models (or other devices) get none of the kernels; AMX where the CPU has it.
    assert cpu_ops.CpuKernels.for_model(torch.device("cpu"), torch.float32, head_dim=64) == cpu_ops.NO_KERNELS
    assert not cpu_ops.CpuKernels.for_model(torch.device("cpu"), torch.bfloat16, head_dim=72).decode_attention
    assert cpu_ops.CpuKernels.for_model(torch.device("cpu"), torch.bfloat16, 64).amx == cpu_ops.cpu_supports_amx()


needs_amx = pytest.mark.skipif(not cpu_ops.cpu_supports_amx(), reason="this CPU has no AMX")


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 300])  # C tiles narrower than 16, one pass, several
@pytest.mark.parametrize("k,n", [(32, 64), (576, 96), (1536, 32)])
def test_amx_linear_matches_float32_linear_and_no_row_depends_on_the_others(kernel, rows, k, n):
    torch.manual_seed(rows + k)
    x, w, b = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    got = torch.ops.pagekube_cpu.bf16_amx_linear(x, w, b)
    torch.testing.assert_close(got.float(), reference(x, w, b), rtol=2**-7, atol=1e-3 * k)
    half = rows // 2 + 1
    for part, want in ((x[:1], got[:1]), (x[-1:], got[-1:]), (x[:half], got[:half]), (x[-half:], got[-half:])):
        assert torch.equal(torch.ops.pagekube_cpu.bf16_amx_linear(part, w, b), want)


@needs_amx
def test_amx_linears_take_every_row_count_up_to_their_limit(kernel):
    w = torch.randn(64, 96).bfloat16()
    kernels = cpu_ops.CpuKernels.for_model(torch.device("cpu"), torch.bfloat16, head_dim=64)
    assert kernels.amx
    x = torch.randn(cpu_ops.AMX_MAX_ROWS + 1, 96).bfloat16()
    for rows in (1, cpu_ops.MAX_ROWS + 1, cpu_ops.AMX_MAX_ROWS):
        assert kernels.takes_linear(x[:rows])
        assert torch.equal(kernels.matmul(x[:rows], w), torch.ops.pagekube_cpu.bf16_amx_linear(x[:rows], w, None))
    assert not kernels.takes_linear(x) and torch.equal(kernels.matmul(x, w), F.linear(x, w))
    odd = torch.randn(40, 96).bfloat16()  # rows not a multiple of 32: the bf16 kernel, then torch
    assert torch.equal(kernels.matmul(x[:2], odd), kernel(x[:2], odd, None))
    with pytest.raises(RuntimeError, match="multiples of 32"):
        torch.ops.pagekube_cpu.bf16_amx_linear(x[:2], odd, None)


@needs_amx
def test_without_batch_invariance_small_steps_take_the_avx512_kernel(kernel, monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    kernels = cpu_ops.CpuKernels.for_model(torch.device("cpu"), torch.bfloat16, head_dim=64)
    assert kernels.amx and not kernels.batch_invariant
    w, x = torch.randn(64, 96).bfloat16(), torch.randn(cpu_ops.AVX512_ROWS_BEFORE_AMX + 1, 96).bfloat16()
    small = x[:cpu_ops.AVX512_ROWS_BEFORE_AMX]
    assert torch.equal(kernels.matmul(small, w), kernel(small, w, None))
    assert torch.equal(kernels.matmul(x, w), torch.ops.pagekube_cpu.bf16_amx_linear(x, w, None))


def test_generated_rows_take_the_decode_kernel_each_over_its_causal_prefix_and_prompt_rows_the_prefill_path(kernel):
    """A step with a speculative chunk (5 generated rows), a prompt chunk (4 rows), a recomputed sequence (3 prompt
    rows, then 2 generated) and a plain decode: every row equals causal attention over its own prefix."""
    from pagekube.engine.model.attention import TorchAttention
    from pagekube.engine.model.model import AttentionMetadata

    torch.manual_seed(0)
    heads, kv_heads, dim, block_size, blocks = 9, 3, 64, 16, 12
    k_cache = torch.randn(blocks, block_size, kv_heads, dim).bfloat16()
    v_cache = torch.randn(blocks, block_size, kv_heads, dim).bfloat16()
    query_lens, context, prompt_rows = [5, 4, 5, 1], [37, 20, 30, 9], [0, 4, 3, 0]
    tables = torch.tensor([[0, 1, 2, 0], [3, 4, 0, 0], [5, 6, 7, 0], [8, 0, 0, 0]], dtype=torch.int32)
    starts = [0, 5, 9, 14, 15]
    q = torch.randn(starts[-1], heads, dim).bfloat16()
    meta = AttentionMetadata(slot_mapping=torch.empty(0), block_tables=tables,
                             query_start_loc=torch.tensor(starts, dtype=torch.int32),
                             context_lens=torch.tensor(context, dtype=torch.int32), query_lens=query_lens,
                             context_lens_list=context, prompt_rows=prompt_rows)
    backend = TorchAttention()
    backend.kernels = cpu_ops.CpuKernels(decode_attention=True)
    got = backend.attend(q, k_cache, v_cache, meta, dim**-0.5)
    want = paged_attention_ref(q, k_cache, v_cache, tables, starts, context, dim**-0.5)
    torch.testing.assert_close(got.float(), want.float(), **BF16)
    decodes, prefills = meta.derived["torch_kernel"]
    assert decodes[0].tolist() == [0, 1, 2, 3, 4, 12, 13, 14] and decodes[2].tolist() == [33, 34, 35, 36, 37, 29, 30, 9]
    assert prefills == [(1, 5, 9, 20), (2, 9, 12, 28)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 1),
                                                                  (6, 1, 32, 32), (4, 2, 80, 16), (2, 2, 16, 16)])
@pytest.mark.parametrize("seqs", [1, 7])  # one: a task per KV head; seven: a task per sequence (2 threads)
def test_paged_decode_attention_matches_reference(kernel, heads, kv_heads, head_dim, block_size, seqs):
    """One query per sequence over contexts of 1 to ~300 tokens in shuffled blocks, GQA groups of 1 to 6, head
    sizes of one to eight 32-dim chunks (80 and 16: the last chunk half)."""
    torch.manual_seed(heads * 100 + head_dim)
    max_blocks = 300 // block_size + 1
    num_blocks = seqs * max_blocks + 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).bfloat16()
    tables = torch.randperm(num_blocks)[:seqs * max_blocks].view(seqs, max_blocks).int()
    lens = torch.tensor([1, 2, block_size, block_size + 1, 77, 255, 300][-seqs:], dtype=torch.int32)
    q = torch.randn(seqs, heads, head_dim).bfloat16()
    got = torch.ops.pagekube_cpu.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    want = paged_attention_ref(q, k_cache, v_cache, tables, list(range(seqs + 1)), lens.tolist(), head_dim**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2e-2)


def test_paged_decode_attention_refuses_a_context_past_its_block_table(kernel):
    cache = torch.zeros(4, 16, 1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="out of its block table"):
        torch.ops.pagekube_cpu.paged_decode_attention(torch.zeros(1, 1, 64).bfloat16(), cache, cache,
                                                      torch.zeros(1, 2, dtype=torch.int32),
                                                      torch.tensor([33], dtype=torch.int32), 1.0)


BF16 = dict(rtol=2**-7, atol=2e-2)  # one bf16 rounding apart (the torch path rounds after each op)


@pytest.mark.parametrize("rows,dim", [(1, 576), (3, 64), (40, 100)])
def test_rms_norm_and_add_rms_norm_match_the_torch_path(kernel, rows, dim):
    torch.manual_seed(rows + dim)
    norm = RMSNorm(dim, 1e-5).bfloat16()
    norm.weight.data = torch.randn(dim).bfloat16()
    x, residual = torch.randn(rows, dim).bfloat16(), torch.randn(rows, dim).bfloat16()
    torch.testing.assert_close(torch.ops.pagekube_cpu.rms_norm(x, norm.weight, 1e-5), norm._norm(x), **BF16)
    want_sum = residual + x
    in_place = residual.clone()
    got = torch.ops.pagekube_cpu.add_rms_norm(x, in_place, norm.weight, 1e-5)
    assert torch.equal(in_place, want_sum)  # the residual stream is updated in place, rounded as torch rounds
    torch.testing.assert_close(got, norm._norm(want_sum), **BF16)


def test_rms_norm_module_takes_the_fused_path_and_returns_the_residual(kernel):
    norm = RMSNorm(64, 1e-6).bfloat16()
    norm.kernels = cpu_ops.CpuKernels.for_model(torch.device("cpu"), torch.bfloat16, head_dim=64)
    x, residual = torch.randn(2, 64).bfloat16(), torch.randn(2, 64).bfloat16()
    want_sum = residual + x
    out, stream = norm(x, residual)
    assert stream is residual and torch.equal(stream, want_sum)
    torch.testing.assert_close(out, norm._norm(want_sum), **BF16)


@pytest.mark.parametrize("rows", [1, 9])
@pytest.mark.parametrize("d", [1536, 40])  # whole 16-wide vectors, and a scalar tail
def test_silu_and_mul_matches_the_torch_path(kernel, rows, d):
    gate_up = torch.randn(rows, 2 * d).bfloat16() * 4
    gate_up[0, :4] = torch.tensor([-200.0, -87.0, 90.0, 300.0])  # beyond exp's float range either way
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(torch.ops.pagekube_cpu.silu_and_mul(gate_up), F.silu(gate) * up, **BF16)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
def test_rope_write_kv_matches_rope_then_write_kv_cache(kernel, heads, kv_heads, head_dim):
    """q rotated and returned; k rotated and v copied to their slots; a -1 slot writes nothing."""
    torch.manual_seed(heads * head_dim)
    t, blocks, block_size = 5, 6, 4
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim).bfloat16()
    angles = torch.rand(t, head_dim // 2) * 6
    cos = torch.cat([angles.cos()] * 2, -1).bfloat16()[:, None, :]
    sin = torch.cat([angles.sin()] * 2, -1).bfloat16()[:, None, :]
    slots = torch.tensor([3, 17, -1, 0, 22])
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (a.reshape(t, -1, head_dim) for a in (q, k, v))
    want_k = torch.zeros(blocks, block_size, kv_heads, head_dim).bfloat16()
    want_v = torch.zeros_like(want_k)
    write_kv_cache_ref(k * cos + rotate_half(k) * sin, v, want_k, want_v, slots)
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    got_q = torch.ops.pagekube_cpu.rope_write_kv(qkv, cos, sin, got_k, got_v, slots, heads, kv_heads)
    torch.testing.assert_close(got_q, q * cos + rotate_half(q) * sin, **BF16)
    torch.testing.assert_close(got_k, want_k, **BF16)
    assert torch.equal(got_v, want_v)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.pagekube_cpu.rope_write_kv(qkv, cos, sin, got_k, got_v, slots + 100, heads, kv_heads)


def test_engine_uses_the_kernels_in_bf16_and_stays_close_to_float32(bundled_dir):
    """End to end on the bundled model: bf16 with the extension (decode attention in place, small-batch linears,
    mixed steps) gives text whose first greedy tokens match float32's on a plain prompt."""
    from pagekube.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = ["The capital of France is", "1, 2, 3, 4, 5,"]
    bf16 = LLM(str(bundled_dir), dtype="bfloat16", kv_cache_memory=64 * 1024**2)
    names = ["linear", "gguf_blocks"] + ["amx"] * cpu_ops.cpu_supports_amx() + ["batch_invariant", "fused", "decode_attention"]
    assert cpu_ops.loaded() and bf16.engine.runner.kernels.names == names
    got = [o.outputs[0].token_ids for o in bf16.generate(prompts, params)]
    f32 = LLM(str(bundled_dir), dtype="float32", kv_cache_memory=64 * 1024**2)
    want = [o.outputs[0].token_ids for o in f32.generate(prompts, params)]
    assert [g[:3] for g in got] == [w[:3] for w in want]
