"""Pipeline parallelism on the CPU (gloo): greedy output with the layers split into stages equals one process (an
uneven split, TP x PP, the bundled model under chunked prefill + prefix caching + preemption), each stage loads only
its own layers, a killed rank ends the engine, and two `pagekube serve` processes make one engine as two nodes
would (one --headless)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from pagekube.engine import LLM
from pagekube.engine.distributed.pipeline_parallel import PPStage
from tests.conftest import write_tiny_llama
from tests.server_process import ServerProcess, free_port
from tests.test_tensor_parallel import (
    GREEDY,
    PROMPTS,
    assert_bundled_model_unchanged_under_pressure,
    generate,
    stream_until_killed,
    worker_pids,
)


@pytest.fixture(scope="module")
def tiny_5_layers(bundled_dir, tmp_path_factory) -> Path:
    """5 layers do not split evenly over 2 stages; untied embeddings, so the last stage holds its own LM head."""
    return write_tiny_llama(tmp_path_factory.mktemp("pp-tiny"), bundled_dir, num_hidden_layers=5)


@pytest.mark.parametrize(("layers", "stages", "split"), [
    (5, 2, [3, 2]), (7, 3, [2, 3, 2]), (30, 2, [15, 15]), (9, 4, [2, 2, 3, 2]), (4, 4, [1, 1, 1, 1])])
def test_an_uneven_split_gives_the_extra_layers_to_the_stages_before_the_last(layers, stages, split):
    ranges = [PPStage(s, stages).layers(layers) for s in range(stages)]
    assert [len(r) for r in ranges] == split  # as vLLM's get_pp_indices splits them
    assert [i for r in ranges for i in r] == list(range(layers))


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 2), (1, 3)], ids=["pp2", "tp2xpp2", "pp3"])
def test_pipeline_parallel_greedy_equals_one_process(tiny_5_layers, tp, pp):
    reference, _ = generate(tiny_5_layers, PROMPTS)
    got, llm = generate(tiny_5_layers, PROMPTS, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert got == reference
    model = llm.engine.runner.model  # rank 0's: the first stage's layers, the embedding, no norm or LM head
    held = {int(n.split(".")[2]) for n, _ in model.named_parameters() if n.startswith("model.layers.")}
    assert held == set(PPStage(0, pp).layers(5))
    assert not any(n.startswith(("model.norm", "lm_head")) for n, _ in model.named_parameters())
    assert llm.engine.runner.num_layers == len(held)


def test_bundled_model_in_two_stages_with_chunked_prefill_prefix_caching_and_preemption(bundled_dir):
    stage_block = 2 * 15 * 16 * 3 * 64 * 4  # 15 layers per stage, 3 KV heads, float32
    assert_bundled_model_unchanged_under_pressure(bundled_dir, stage_block, pipeline_parallel_size=2)


def test_a_model_with_fewer_layers_than_stages_is_refused(tiny_5_layers):
    with pytest.raises(ValueError, match="pipeline-parallel-size 6: the model cannot be split: its 5 layers"):
        LLM(str(tiny_5_layers), pipeline_parallel_size=6)


@pytest.mark.parametrize("flags", [
    {"pipeline_parallel_size": 2, "enable_lora": True},
    {"pipeline_parallel_size": 3, "nnodes": 2},
    {"nnodes": 2, "node_rank": 1, "tensor_parallel_size": 2},
    {"nnodes": 2, "headless": True, "tensor_parallel_size": 2},
    {"nnodes": 2, "node_rank": 2, "headless": True, "tensor_parallel_size": 2},
], ids=["lora", "nnodes-not-dividing", "worker-node-not-headless", "leader-headless", "node-rank-too-large"])
def test_parallel_settings_that_cannot_work_are_refused(flags):
    from pydantic import ValidationError

    from pagekube.engine.config import EngineConfig

    with pytest.raises(ValidationError):
        EngineConfig(**flags)


def test_an_idle_engine_outlives_the_collective_timeout(tiny_5_layers, monkeypatch):
    """Workers wait for the next step without a deadline (the step's collectives keep theirs): before, a rank idle
    past the gloo timeout died, and the engine with it."""
    monkeypatch.setenv("PAGEKUBE_COLLECTIVE_TIMEOUT_S", "2")
    llm = LLM(str(tiny_5_layers), dtype="float32", pipeline_parallel_size=2)
    try:
        time.sleep(5)
        assert llm.engine.workers.poll() is None
        assert len(llm.generate(PROMPTS[:1])[0].outputs[0].token_ids) > 0
    finally:
        llm.close()


@pytest.mark.timeout(240)
def test_a_killed_stage_makes_the_server_report_dead_and_exit_nonzero(tiny_5_layers):
    srv = ServerProcess(str(tiny_5_layers), "-pp", "2", "--dtype", "float32")
    try:
        srv.wait_ready()
        [worker] = worker_pids(srv.proc.pid)
        rest = stream_until_killed(srv.url, tiny_5_layers.name, lambda: os.kill(worker, signal.SIGKILL))
        assert any("engine_dead" in line for line in rest), rest[-3:]
        assert srv.proc.wait(timeout=30) == 1
        assert "worker rank 1 (pipeline stage 1) died" in srv.log()
    finally:
        srv.stop()


def multi_node(model: Path, tmp_path: Path, worker_delay: float = 0, env: dict | None = None):
    """Two `pagekube serve` processes as two nodes of one engine (TP 1 x PP 2): the leader serves the API; the
    worker starts `worker_delay` seconds after it (pods of a group start minutes apart)."""
    rendezvous = ["-pp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                  "--dtype", "float32"]
    leader = ServerProcess(str(model), *rendezvous, "--node-rank", "0", log_path=tmp_path / "leader.log", env=env)
    time.sleep(worker_delay)
    worker = ServerProcess(str(model), *rendezvous, "--node-rank", "1", "--headless", log_path=tmp_path / "worker.log",
                           env=env)
    return leader, worker


@pytest.mark.timeout(240)
def test_multi_node_on_loopback_waits_for_a_late_node_serves_and_a_lost_one_ends_the_leader(tiny_5_layers, tmp_path):
    llm = LLM(str(tiny_5_layers), dtype="float32")
    try:
        reference = llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].text
    finally:
        llm.close()
    # The leader waits for a late worker past the collective timeout (the rendezvous has its own, of minutes).
    leader, worker = multi_node(tiny_5_layers, tmp_path, worker_delay=6, env={"PAGEKUBE_COLLECTIVE_TIMEOUT_S": "3"})
    try:
        leader.wait_ready()
        with pytest.raises(httpx.ConnectError):  # a headless node serves no API
            httpx.get(worker.url + "/health", timeout=2)
        got = httpx.post(leader.url + "/v1/completions", timeout=60, json={
            "model": tiny_5_layers.name, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}).json()
        assert got["choices"][0]["text"] == reference
        worker.signal(signal.SIGTERM)  # handled: the headless node waits for the leader to stop it
        time.sleep(1)
        assert worker.proc.poll() is None
        os.killpg(worker.proc.pid, signal.SIGKILL)  # the node is lost: the idle leader notices by its heartbeat
        lost = time.monotonic()
        assert leader.proc.wait(timeout=30) == 1
        assert time.monotonic() - lost < 15
        assert "engine loop died" in leader.log()
    finally:
        worker.stop()
        leader.stop()


@pytest.mark.timeout(240)
def test_multi_node_leader_stop_ends_the_headless_node_cleanly(tiny_5_layers, tmp_path):
    leader, worker = multi_node(tiny_5_layers, tmp_path)
    try:
        leader.wait_ready()
        leader.signal(signal.SIGTERM)  # drain, then stop every rank
        assert leader.proc.wait(timeout=60) == 0
        assert worker.proc.wait(timeout=30) == 0, worker.log()
    finally:
        worker.stop()
        leader.stop()
