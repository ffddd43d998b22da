"""CUDA graphs for decode steps (engine/model/cuda_graphs.py): vLLM's capture sizes, when steps run eagerly, and
the graphs' contract (inputs only through persistent buffers, padding rows inert), checked on the CPU with the
stand-in graph (it replays by calling the captured forward again over the same buffers) and the Triton attention
backend interpreted; on a GPU (bench/gpu_check.sh) with the real CUDAGraph."""

from __future__ import annotations

import pytest
import torch

from pagekube.engine import SamplingParams
from pagekube.engine.config import EngineConfig
from pagekube.engine.llm_engine import LLMEngine
from pagekube.engine.model.cuda_graphs import CudaGraph, StandInGraph, capture_sizes, eager_reason

CUDA = torch.device("cuda")
GRAPH = CudaGraph if torch.cuda.is_available() else StandInGraph  # bench/gpu_check.sh runs these on a GPU


@pytest.mark.parametrize("flag, max_num_seqs, sizes", [
    (None, 256, [1, 2, 4] + list(range(8, 257, 8))),
    (None, 20, [1, 2, 4, 8, 16]),  # a 17..20 row decode runs eagerly, as in vLLM
    ([32], 256, [1, 2, 4, 8, 16, 24, 32]),
    ([3], 256, [1, 2]),
    ([1, 3, 100, 512], 256, [1, 3, 100]),  # several: exactly those, none above --max-num-seqs
])
def test_capture_sizes_follow_vllms_rule(flag, max_num_seqs, sizes):
    assert capture_sizes(flag, max_num_seqs) == sizes


@pytest.mark.parametrize("kw, device, backend, world, says", [
    ({}, CUDA, "triton", 1, None),
    ({}, torch.device("cpu"), "torch", 1, "not on a CUDA device"),
    ({"enforce_eager": True}, CUDA, "triton", 1, "--enforce-eager"),
    ({}, CUDA, "torch", 1, "torch attention backend"),
    ({}, CUDA, "triton", 2, "parallelism"),
    ({"enable_lora": True}, CUDA, "triton", 1, "--enable-lora"),
])
def test_decode_steps_run_eagerly_only_for_a_stated_reason(kw, device, backend, world, says):
    config = EngineConfig(**kw)
    reason = eager_reason(config, device, backend, world, config.enable_lora)
    assert reason == says if says is None else says in reason


def test_graph_sizes_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig(cuda_graph_sizes=[0, 8])


def greedy(engine: LLMEngine, prompts: list[str]) -> dict[str, list[int]]:
    # Different lengths, so the decode batch shrinks as requests finish: 5 rows, then 4, 3, 2, 1.
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def tiny_engine(tiny_dir) -> LLMEngine:
    """The tiny random model with its query and key projections scaled up: a random init attends almost uniformly,
    so positions and context would barely move its output; these make a stale or missing input show."""
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), dtype="float32", attention_backend="triton",
                                    kv_cache_memory=8 * 1024**2, enforce_eager=True))  # the tests capture
    for layer in engine.runner.model.model.local_layers:
        qkv = layer.self_attn.qkv_proj
        q_rows, k_rows, _ = qkv.output_sizes
        with torch.no_grad():
            qkv.weight[:q_rows + k_rows] *= 8
    return engine


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 1, 2, 3, 5,", "Kubernetes"]


@pytest.mark.parametrize("sizes", [[1, 2, 4, 8], [1, 2]], ids=["all-captured", "largest-2"])
def test_decode_steps_replayed_from_graphs_give_the_eager_engines_tokens(tiny_dir, sizes):
    """Replays at padded sizes (5 rows in the 8 graph, 3 in the 4) and eager steps above the largest size give
    the same greedy tokens as an engine without graphs; prefill steps never replay."""
    eager = greedy(tiny_engine(tiny_dir), PROMPTS)
    graphed = tiny_engine(tiny_dir)
    graphed.runner.capture_cuda_graphs(sizes, graphed.max_model_len, GRAPH)
    assert greedy(graphed, PROMPTS) == eager
    # Request i decodes 2 + 2i steps after its first token: rows per decode step 5, 5, 4, 4, 3, 3, 2, 2, 1, 1.
    rows = [sum(2 + 2 * i >= s for i in range(len(PROMPTS))) for s in range(1, 11)]
    assert graphed.runner.graphs.replays == sum(r <= sizes[-1] for r in rows)  # 10 and 4: the rest ran eagerly


def test_padding_rows_write_no_kv_and_inputs_come_only_from_the_buffers(tiny_dir):
    """Four live rows, then three in the same graph of four: the KV pool changes at the live rows' (block, offset) slots only (the
    padding row's slot from the step before is not reused), and each step gives its eager result over a cache of
    random context (a graph reading stale tensors, or missing one input, would not)."""
    engine = tiny_engine(tiny_dir)
    runner = engine.runner
    gen = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    runner.capture_cuda_graphs([4], engine.max_model_len, GRAPH)
    graphs = runner.graphs
    for step, (start, tokens) in enumerate([(5, [11, 12, 13, 14]), (9, [21, 22, 23])]):
        items = [([1 + i, 7 + i], start + i + 4 * step, [tok], 1, 0) for i, tok in enumerate(tokens)]
        before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        runner.graphs = None
        eager = runner.forward(items)
        eager_kv = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
            k.copy_(k0), v.copy_(v0)
        runner.graphs, graphs.replays = graphs, 0
        graphed = runner.forward(items)
        assert graphs.replays == 1
        torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
        for (k, v), (ek, ev), (k0, _) in zip(runner.kv_caches, eager_kv, before, strict=True):
            written = (k != k0).any(-1).any(-1).nonzero().tolist()
            assert written == [[1 + i, start + i + 4 * step] for i in range(len(tokens))], step  # live slots only
            torch.testing.assert_close((k, v), (ek, ev), rtol=1e-5, atol=1e-5)  # (GEMMs of 4 rows vs 3: rounding)
        assert not torch.equal(runner.kv_caches[0][0], before[0][0])  # it did write


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on a GPU only")
def test_an_engine_on_cuda_captures_its_decode_graphs_at_start(tiny_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), max_num_seqs=16, kv_cache_memory=8 * 1024**2))
    assert engine.runner.graphs is not None and engine.runner.graphs.sizes == [1, 2, 4, 8, 16]
    greedy(engine, PROMPTS)
    assert engine.runner.graphs.replays > 0
