"""Tensor parallelism on the CPU (gloo): greedy output with N ranks equals one rank, KV-head replication, the
bundled model over 3 ranks under chunked prefill + prefix caching + preemption, and a worker that dies."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from pagekube.engine import LLM, SamplingParams
from tests.conftest import write_tiny_llama
from tests.server_process import ServerProcess

PROMPTS = ["Hello there, my friend", "The capital of France is", "1 2 3 4 5 6", "Kubernetes schedules pods"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def generate(model, prompts, params=GREEDY, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model), dtype="float32", **kwargs)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm
    finally:
        llm.close()


@pytest.fixture(scope="module")
def tiny_4q_2kv(bundled_dir, tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tp-tiny"), bundled_dir)  # 4 query heads, 2 KV heads


@pytest.mark.parametrize("size", [2, 4], ids=["tp2-split-kv", "tp4-replicated-kv"])
def test_tensor_parallel_greedy_equals_one_rank(tiny_4q_2kv, size):
    reference, _ = generate(tiny_4q_2kv, PROMPTS)
    got, llm = generate(tiny_4q_2kv, PROMPTS, tensor_parallel_size=size)
    assert got == reference
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (4 // size, 2 // size if size <= 2 else 1)


def assert_bundled_model_unchanged_under_pressure(bundled_dir, rank_block_bytes: int, **parallel) -> None:
    """Greedy output equals one process's with the model split as `parallel` says, under chunked prefill (24-token
    steps), prefix caching (a shared system prompt) and preemption (9 blocks per rank's pool)."""
    shared = "You are a helpful assistant. Answer in one short sentence. Question: "
    prompts = [shared + q for q in ("What is a pod?", "What is a node?", "What is etcd?", "Why use a GPU?")]
    reference, _ = generate(bundled_dir, prompts)
    got, llm = generate(bundled_dir, prompts, max_num_batched_tokens=24, enable_prefix_caching=True,
                        kv_cache_memory=9 * rank_block_bytes, **parallel)
    assert got == reference
    engine = llm.engine
    assert engine.runner.num_blocks == 9 and engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_cache_hits > 0


def test_bundled_model_over_three_ranks_with_chunked_prefill_prefix_caching_and_preemption(bundled_dir):
    rank_block = 2 * 30 * 16 * 1 * 64 * 4  # 30 layers, one KV head per rank, float32
    assert_bundled_model_unchanged_under_pressure(bundled_dir, rank_block, tensor_parallel_size=3)


def test_a_model_that_does_not_split_is_refused(tiny_4q_2kv):
    with pytest.raises(ValueError, match="tensor-parallel-size 3: the model cannot be split: its 4 attention heads"):
        LLM(str(tiny_4q_2kv), tensor_parallel_size=3)


def worker_pids(parent: int) -> list[int]:
    """The spawned tensor-parallel workers among a process's children (not multiprocessing's resource tracker)."""
    children = [c for task in Path(f"/proc/{parent}/task").iterdir() for c in (task / "children").read_text().split()]
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def stream_until_killed(url: str, model: str, kill) -> list[str]:
    """Start a long stream, run `kill()` once it is generating, and return the rest of the stream."""
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        kill()
        return list(lines)


@pytest.mark.timeout(240)
def test_a_killed_worker_makes_the_server_report_dead_and_exit_nonzero(tiny_4q_2kv):
    srv = ServerProcess(str(tiny_4q_2kv), "-tp", "2", "--dtype", "float32")
    try:
        srv.wait_ready()
        [worker] = worker_pids(srv.proc.pid)
        killed = []
        rest = stream_until_killed(srv.url, tiny_4q_2kv.name,
                                   lambda: (os.kill(worker, signal.SIGKILL), killed.append(time.monotonic())))
        assert any("engine_dead" in line for line in rest), rest[-3:]  # the stream ended, it did not hang
        assert time.monotonic() - killed[0] < 10
        assert srv.proc.wait(timeout=30) == 1
        assert "tensor-parallel worker rank 1 died" in srv.log()
    finally:
        srv.stop()
