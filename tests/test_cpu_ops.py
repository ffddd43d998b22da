"""The CPU extension against its references: the bf16 linear vs float32 linear, paged decode vs the torch path."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from pagekube.kernels import cpu_ops
from pagekube.kernels.reference import paged_attention_ref

pytestmark = pytest.mark.skipif(not cpu_ops.cpu_supports_bf16_dot(), reason="this CPU has no AVX512_BF16")


@pytest.fixture(scope="module")
def kernel():
    assert shutil.which("g++") or shutil.which("c++"), "scripts/test-deps.sh installs g++"
    assert cpu_ops.load_cpu_kernels(), "the kernel should build where the CPU and a compiler allow it"
    return torch.ops.pagekube_cpu.bf16_linear


def reference(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 9, 17])  # every unrolled block size, and several passes
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


def test_linear_uses_the_kernel_only_for_small_bf16_batches(kernel):
    w = torch.randn(40, 96).bfloat16()
    small, large = torch.randn(cpu_ops.MAX_ROWS, 96).bfloat16(), torch.randn(cpu_ops.MAX_ROWS + 1, 96).bfloat16()
    assert cpu_ops.uses_bf16_kernel(small, w) and not cpu_ops.uses_bf16_kernel(large, w)
    assert torch.equal(cpu_ops.linear(small, w), kernel(small, w, None))
    assert torch.equal(cpu_ops.linear(large, w), F.linear(large, w))
    assert not cpu_ops.uses_bf16_kernel(small.float(), w.float())


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 1),
                                                                  (6, 1, 32, 32)])
def test_paged_decode_attention_matches_reference(kernel, heads, kv_heads, head_dim, block_size):
    """One query per sequence over contexts of 1 to ~300 tokens in shuffled blocks, GQA groups of 1 to 6."""
    torch.manual_seed(heads * 100 + head_dim)
    seqs, max_blocks = 7, 300 // block_size + 1
    num_blocks = seqs * max_blocks + 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).bfloat16()
    tables = torch.randperm(num_blocks)[:seqs * max_blocks].view(seqs, max_blocks).int()
    lens = torch.tensor([1, 2, block_size, block_size + 1, 77, 255, 300], dtype=torch.int32)
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


def test_engine_uses_the_kernels_in_bf16_and_stays_close_to_float32(bundled_dir):
    """End to end on the bundled model: bf16 with the extension (decode attention in place, small-batch linears,
    mixed steps) gives text whose first greedy tokens match float32's on a plain prompt."""
    from pagekube.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = ["The capital of France is", "1, 2, 3, 4, 5,"]
    bf16 = LLM(str(bundled_dir), dtype="bfloat16", kv_cache_memory=64 * 1024**2)
    assert cpu_ops.loaded()
    got = [o.outputs[0].token_ids for o in bf16.generate(prompts, params)]
    f32 = LLM(str(bundled_dir), dtype="float32", kv_cache_memory=64 * 1024**2)
    want = [o.outputs[0].token_ids for o in f32.generate(prompts, params)]
    assert [g[:3] for g in got] == [w[:3] for w in want]
