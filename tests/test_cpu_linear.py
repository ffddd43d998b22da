"""The CPU bf16 linear kernel against torch's linear in float32 over the same bf16 inputs."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from pagekube.kernels import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.cpu_supports_bf16_dot(), reason="this CPU has no AVX512_BF16")


@pytest.fixture(scope="module")
def kernel():
    assert shutil.which("g++") or shutil.which("c++"), "scripts/test-deps.sh installs g++"
    assert cpu_linear.load_bf16_kernel(), "the kernel should build where the CPU and a compiler allow it"
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
    small, large = torch.randn(cpu_linear.MAX_ROWS, 96).bfloat16(), torch.randn(cpu_linear.MAX_ROWS + 1, 96).bfloat16()
    assert cpu_linear.uses_bf16_kernel(small, w) and not cpu_linear.uses_bf16_kernel(large, w)
    assert torch.equal(cpu_linear.linear(small, w), kernel(small, w, None))
    assert torch.equal(cpu_linear.linear(large, w), F.linear(large, w))
    assert not cpu_linear.uses_bf16_kernel(small.float(), w.float())
