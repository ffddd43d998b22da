"""GGUF weights kept in their blocks (Q4_1 linears, the Q8_0 tied embedding as lm_head): the packing against
gguf-py's own dequantizer; both kernels over the blocks (AVX-512, and AMX where the CPU has it) against float32
linear over the bf16 copy's weights, which they must reproduce exactly, row by row whatever the batch; the converter
against the bundled model's dequantized weights; the engine reading them."""

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


def random_q8_0(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """GGUF Q8_0 rows: per 32 weights a float16 scale, then 32 int8."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 32, 34), dtype=np.uint8)
    d = (rng.standard_normal((rows, cols // 32)) * 0.002).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(rows, cols // 32, 2)
    return blocks


RANDOM = {"Q4_1": random_q4_1, "Q8_0": random_q8_0}
FORMATS = pytest.mark.parametrize("fmt", list(RANDOM))


def random_weight(fmt: str, rows: int, cols: int, seed: int = 0):
    return gguf_linears.PACKERS[fmt](RANDOM[fmt](rows, cols, seed))


@FORMATS
@pytest.mark.parametrize("cols", [64, 576, 1536])
def test_pack_stands_for_the_weights_gguf_dequantizes(fmt, cols):
    blocks = RANDOM[fmt](40, cols)
    want = gguf.quants.dequantize(blocks.reshape(40, -1), gguf.GGMLQuantizationType[fmt])
    got = gguf_linears.unpack(gguf_linears.PACKERS[fmt](blocks))
    assert got.shape == (40, cols)
    np.testing.assert_array_equal(got.numpy(), want)


needs_kernel = pytest.mark.skipif(not cpu_ops.cpu_supports_bf16_dot(), reason="this CPU has no AVX512_BF16")
needs_amx = pytest.mark.skipif(not cpu_ops.cpu_supports_amx(), reason="this CPU has no AMX")
BOTH_KERNELS = pytest.mark.parametrize("amx", [False, pytest.param(True, marks=needs_amx)], ids=["avx512", "amx"])


@needs_kernel
@BOTH_KERNELS
@FORMATS
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 33, 70])  # AVX-512: the unrolled blocks; AMX: one and two passes
@pytest.mark.parametrize("cols", [64, 576, 1536])  # one block pair; scales in full vectors of 16 and a tail
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_float32_linear_over_the_bf16_weights(amx, fmt, rows, cols, with_bias):
    assert cpu_ops.load_cpu_kernels()
    torch.manual_seed(rows + cols)
    w = random_weight(fmt, 67, cols, seed=cols)
    x, b = torch.randn(rows, cols).bfloat16(), torch.randn(67).bfloat16() if with_bias else None
    got = cpu_ops.gguf_linear(x, w, b, amx=amx)
    bf16_weights = gguf_linears.unpack(w).bfloat16().float()
    want = F.linear(x.float(), bf16_weights, None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 67)
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-2)  # float sums, one bf16 rounding


@needs_kernel
@BOTH_KERNELS
@FORMATS
def test_kernels_compute_with_exactly_the_bf16_copys_weights(amx, fmt):
    """Rows of the identity pick single weights out: each must equal, bit for bit, the bf16 rounding of d*q + m
    (Q8_0: d*q) that the engine's bf16 copy holds (so a step through the blocks and a step through the copy multiply
    by the same numbers). The gguf float32 weights themselves are not bf16 numbers: a kernel reading those would
    fail here."""
    assert cpu_ops.load_cpu_kernels()
    w = random_weight(fmt, 40, 576, seed=3)
    exact = gguf_linears.unpack(w)
    assert not torch.equal(exact.bfloat16().float(), exact)
    got = cpu_ops.gguf_linear(torch.eye(576).bfloat16(), w, amx=amx)
    assert torch.equal(got, exact.bfloat16().T.contiguous())


@needs_kernel
@BOTH_KERNELS
@FORMATS
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(amx, fmt):
    assert cpu_ops.load_cpu_kernels()
    w = random_weight(fmt, 96, 576, seed=5)
    x = torch.randn(300, 576).bfloat16()
    everything = cpu_ops.gguf_linear(x, w, amx=amx)
    for rows in (1, 2, 5, 8, 9, 16, 17, 32, 33, 100):
        assert torch.equal(cpu_ops.gguf_linear(x[:rows], w, amx=amx), everything[:rows]), rows
        assert torch.equal(cpu_ops.gguf_linear(x[-rows:], w, amx=amx), everything[-rows:]), rows


@needs_kernel
@BOTH_KERNELS
@FORMATS
@pytest.mark.parametrize("rows", [1, 8, 37])  # AVX-512: streamed and tiled
def test_the_kernel_over_the_blocks_equals_it_over_the_bf16_weights(amx, fmt, rows):
    """The same values in the same order: the blocks and the bf16 copy give identical results, so a model with
    blocks and one without (a Linear whose tensor-parallel cut splits a block pair, a vocabulary shard with padding
    rows) add up the same way."""
    assert cpu_ops.load_cpu_kernels()
    w = random_weight(fmt, 64, 1536, seed=7)
    x, b = torch.randn(rows, 1536).bfloat16(), torch.randn(64).bfloat16()
    from_blocks = cpu_ops.gguf_linear(x, w, b, amx=amx)
    bf16_weights = gguf_linears.unpack(w).bfloat16()
    from_weights = (torch.ops.pagekube_cpu.bf16_amx_linear if amx else torch.ops.pagekube_cpu.bf16_linear)(
        x, bf16_weights, b)
    assert torch.equal(from_blocks, from_weights)


@needs_kernel
def test_kernels_refuse_a_width_they_cannot_split():
    assert cpu_ops.load_cpu_kernels()
    w, w8 = gguf_linears.pack(random_q4_1(8, 64)), gguf_linears.pack_q8(random_q8_0(8, 96))
    with pytest.raises(RuntimeError, match="multiple of 64"):
        torch.ops.pagekube_cpu.q4_1_linear(torch.randn(1, 96).bfloat16(), w.qs, w.d, w.m, None)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        torch.ops.pagekube_cpu.q8_0_linear(torch.randn(1, 96).bfloat16(), w8.qs, w8.d, None)


def test_converter_keeps_every_bundled_linear_exactly(bundled_dir):
    """The bundled SmolLM2 GGUF is Q4_1 in all 7 projections of its 30 layers and Q8_0 in its embedding, which is
    also its lm_head (tied); each packed tensor reproduces the dequantized weight transformers wrote, with llama's
    q/k rows un-permuted as transformers does."""
    packed = load_file(bundled_dir / gguf_linears.FILE)
    state = load_file(bundled_dir / "model.safetensors")
    names = sorted(k.removesuffix(".qs") for k in packed if k.endswith(".qs"))
    assert len(names) == 7 * 30 + 1
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.29.mlp.down_proj.weight" in names
    for name in names:
        if name == "model.embed_tokens.weight":
            w = gguf_linears.Q8Weight(packed[f"{name}.qs"], packed[f"{name}.d"])
        else:
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
def test_engine_reads_the_blocks_and_gets_the_bf16_weights_results(bundled_dir):
    """In bf16, every fused Linear of the bundled model carries its Q4_1 blocks and reads them (AMX: up to
    AMX_MAX_ROWS rows; AVX-512: at every row count), and the tied lm_head its Q8_0 blocks. A layer's output and the
    logits through the blocks equal, bit for bit, those through the bf16 weights."""
    from pagekube.engine import LLM

    llm = LLM(str(bundled_dir), dtype="bfloat16", kv_cache_memory=32 * 1024**2)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 30 and all(m.blocks is not None for m in linears)  # qkv, o, gate_up, down
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.kernels.gguf_blocks and llm.engine.runner.kernels == layer.kernels  # one choice for the whole model
    limit = cpu_ops.AMX_MAX_ROWS if layer.kernels.amx else None  # past it, torch's AMX GEMM over the bf16 weights
    sizes = [1, 3, cpu_ops.MAX_ROWS + 1] + ([limit, limit + 1] if limit else [300])
    x = torch.randn(max(sizes), layer.in_features).bfloat16()
    block_calls = []
    real_blocks = cpu_ops.gguf_linear
    cpu_ops.gguf_linear = lambda *a, **k: block_calls.append(a[0].shape[0]) or real_blocks(*a, **k)
    try:
        for rows in sizes:
            layer(x[:rows])
    finally:
        cpu_ops.gguf_linear = real_blocks
    assert block_calls == [rows for rows in sizes if limit is None or rows <= limit]
    hidden = torch.randn(3, model.config.hidden_size).bfloat16()
    with torch.no_grad():
        blocks = model.model.layers[3].mlp(hidden.clone())
        for m in linears:
            m.blocks, m.saved = None, m.blocks
        weights = model.model.layers[3].mlp(hidden.clone())
        for m in linears:
            m.blocks = m.saved
    assert torch.equal(blocks, weights)
    embedding = model.model.embed_tokens
    assert isinstance(embedding.blocks, gguf_linears.Q8Weight)
    with torch.no_grad():
        logits = model.compute_logits(hidden)
        embedding.blocks, saved = None, embedding.blocks
        from_weights = model.compute_logits(hidden)
        embedding.blocks = saved
    assert torch.equal(logits, from_weights)


@pytest.mark.parametrize("tp, pp", [(3, 1), (1, 2), (3, 2)], ids=["tp3", "pp2", "tp3-pp2"])
def test_each_parallel_rank_takes_the_blocks_of_its_own_slice(bundled_dir, tp, pp):
    """Under tensor parallelism each rank's Linears get the blocks of exactly the rows (q/k/v, gate/up) or input
    columns (o, down) it holds, under pipeline parallelism only its stage's layers: every rank's blocks stand for
    its own weights (the loader's slices of the float32 checkpoint), bit for bit."""
    from transformers import AutoConfig

    from pagekube.engine.distributed.pipeline_parallel import PPStage
    from pagekube.engine.distributed.tensor_parallel import TPShard
    from pagekube.engine.model.model_loader import load_model

    config = AutoConfig.from_pretrained(bundled_dir)
    for stage_rank in range(pp):
        for rank in range(tp):
            stage = PPStage(rank=stage_rank, size=pp, tp_size=tp, tp_rank=rank)
            model = load_model(config, bundled_dir, torch.float32, torch.device("cpu"), TPShard(rank, tp), stage=stage)
            linears = [m for m in model.modules() if isinstance(m, Linear)]
            assert len(linears) == 4 * len(model.model.local_layers)
            embedding = getattr(model.model, "embed_tokens", None)  # the first stage's, and the last's (tied head)
            assert gguf_linears.attach(model, bundled_dir) == len(linears) + (embedding is not None)
            for m in linears + [embedding] * (embedding is not None):
                assert torch.equal(gguf_linears.unpack(m.blocks), m.weight.detach()), (stage_rank, rank)
