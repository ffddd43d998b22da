"""GGUF Q4_1 linears kept in their blocks: the packing against gguf-py's own dequantizer, the kernel against
float32 linear over the same weights, the converter against the bundled model's dequantized weights, and the
engine reading them at one or two rows."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pagekube.engine.model.layers import gguf_linears
from pagekube.engine.model.model import Linear
from pagekube.kernels import cpu_ops


def random_q4_1(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """GGUF Q4_1 rows: per 32 weights a float16 scale and minimum, then 16 bytes of nibbles."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 32, 20), dtype=np.uint8)
    for offset, scale in ((0, 0.02), (2, 0.1)):  # d, then m
        values = (rng.standard_normal((rows, cols // 32)) * scale).astype(np.float16)
        blocks[..., offset:offset + 2] = values.view(np.uint8).reshape(rows, cols // 32, 2)
    return blocks


@pytest.mark.parametrize("cols", [64, 576, 1536])
def test_pack_stands_for_the_weights_gguf_dequantizes(cols):
    blocks = random_q4_1(40, cols)
    want = gguf.quants.dequantize(blocks.reshape(40, -1), gguf.GGMLQuantizationType.Q4_1)
    got = gguf_linears.unpack(gguf_linears.pack(blocks))
    assert got.shape == (40, cols)
    np.testing.assert_array_equal(got.numpy(), want)


needs_kernel = pytest.mark.skipif(not cpu_ops.cpu_supports_bf16_dot(), reason="this CPU has no AVX512_BF16")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9])  # the engine uses 1-2; the kernel takes any number
@pytest.mark.parametrize("cols", [64, 576, 1536])  # one block pair; scales in full vectors of 16 and a tail
@pytest.mark.parametrize("with_bias", [False, True])
def test_q4_kernel_matches_float32_linear(rows, cols, with_bias):
    assert cpu_ops.load_cpu_kernels()
    torch.manual_seed(rows + cols)
    w = gguf_linears.pack(random_q4_1(67, cols, seed=cols))
    x, b = torch.randn(rows, cols).bfloat16(), torch.randn(67).bfloat16() if with_bias else None
    got = cpu_ops.q4_linear(x, w, b)
    want = F.linear(x.float(), gguf_linears.unpack(w), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 67)
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-2)


@needs_kernel
def test_q4_kernel_refuses_a_width_it_cannot_split():
    assert cpu_ops.load_cpu_kernels()
    w = gguf_linears.pack(random_q4_1(8, 64))
    with pytest.raises(RuntimeError, match="multiple of 64"):
        torch.ops.pagekube_cpu.q4_1_linear(torch.randn(1, 96).bfloat16(), w.qs, w.d, w.m, None)


def test_converter_keeps_every_bundled_linear_exactly(bundled_dir):
    """The bundled SmolLM2 GGUF is Q4_1 in all 7 projections of its 30 layers; each packed tensor reproduces the
    dequantized weight transformers wrote, with llama's q/k rows un-permuted as transformers does."""
    packed = load_file(bundled_dir / gguf_linears.FILE)
    state = load_file(bundled_dir / "model.safetensors")
    names = sorted(k.removesuffix(".qs") for k in packed if k.endswith(".qs"))
    assert len(names) == 7 * 30
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.29.mlp.down_proj.weight" in names
    for name in names:
        w = gguf_linears.Q4Weight(*(packed[f"{name}.{p}"] for p in ("qs", "d", "m")))
        assert torch.equal(gguf_linears.unpack(w), state[name]), name


def test_extract_skips_a_tensor_whose_rows_do_not_match(bundled_dir):
    """A weight the GGUF's blocks do not reproduce (here: rows shuffled) is left to the bf16 path, never served."""
    from pagekube.engine.model.model_files import bundled_model_file

    state = load_file(bundled_dir / "model.safetensors")
    name, other = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    some = {name: state[name], other: state[other]}
    assert set(gguf_linears.extract(bundled_model_file(), some)) == {f"{n}.{p}" for n in some for p in ("qs", "d", "m")}
    some[name] = state[name].flip(0)
    assert {k.rsplit(".", 1)[0] for k in gguf_linears.extract(bundled_model_file(), some)} == {other}


@needs_kernel
def test_engine_reads_q4_blocks_at_one_row_and_stays_close_to_bf16(bundled_dir):
    """In bf16, every fused Linear of the bundled model carries its Q4_1 blocks; at one row the logits stay within
    bf16 rounding of the bf16 weights' (the blocks are the exact weights; the bf16 copy rounds them). Greedy text in
bf16 (which takes this path) against float32 is test_cpu_ops' end-to-end test."""
    from pagekube.engine import LLM

    llm = LLM(str(bundled_dir), dtype="bfloat16", kv_cache_memory=32 * 1024**2)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 30 and all(m.q4 is not None for m in linears)  # qkv, o, gate_up, down
    layer = model.model.layers[0].mlp.gate_up_proj
    x = torch.randn(1, layer.in_features).bfloat16()
    assert layer.kernels.q4 and llm.engine.runner.kernels == layer.kernels  # one choice for the whole model
    q4_calls = []
    real_q4 = cpu_ops.q4_linear
    cpu_ops.q4_linear = lambda *a: q4_calls.append(a[0].shape[0]) or real_q4(*a)
    try:
        layer(x), layer(x.expand(2, -1).contiguous()), layer(x.expand(3, -1).contiguous())
    finally:
        cpu_ops.q4_linear = real_q4
    assert q4_calls == [1, 2]  # the blocks at one and two rows, the bf16 weights from three
    torch.testing.assert_close(layer(x).float(), F.linear(x, layer.weight).float(), rtol=0.02, atol=0.05)
    hidden = torch.randn(1, model.config.hidden_size).bfloat16()
    with torch.no_grad():
        quantized = model.model.layers[3].mlp(hidden.clone())
        for m in linears:
            m.q4, m.saved = None, m.q4
        plain = model.model.layers[3].mlp(hidden.clone())
        for m in linears:
            m.q4 = m.saved
    error = (quantized.float() - plain.float()).norm() / plain.float().norm()
    assert 0 < error < 0.01, error  # not the same computation, but the same weights to bf16 rounding
