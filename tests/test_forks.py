"""n > 1: the children fork from choice 0's blocks even when choice 0 finishes on its very first token."""

from __future__ import annotations

import random

import pytest

from pagekube.engine import SamplingParams
from pagekube.engine.core.block_manager import BlockManager
from pagekube.engine.core.sequence import Request
from pagekube.engine.llm_engine import LLMEngine


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[list[int]]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]
    return done


def test_children_fork_before_choice_zero_stops_and_frees_its_blocks(tiny_engine_factory):
    rng = random.Random(7)
    prompt = [rng.randrange(49152) for _ in range(40)]  # 2 full blocks + 1 partial
    rival = [rng.randrange(49152) for _ in range(100)]  # wants every block the finished choice 0 gave back
    seed, n = 123, 4
    sampled = dict(temperature=1.5, max_tokens=8, ignore_eos=True)
    probe = tiny_engine_factory()
    first = run(probe, {str(i): (prompt, SamplingParams(seed=seed + i, **sampled)) for i in range(n)})
    firsts = [first[str(i)][0][0] for i in range(n)]
    assert firsts[0] not in firsts[1:], "pick another seed: a child would stop at once too"
    params = SamplingParams(n=n, seed=seed, stop_token_ids=[firsts[0]], **sampled)
    # Each child i samples from its own generator seeded seed + i: alone, that is an n=1 request with that seed.
    alone = {i: run(tiny_engine_factory(), {"a": (prompt, SamplingParams(
        seed=seed + i, stop_token_ids=[firsts[0]], **sampled))})["a"][0] for i in range(n)}

    tight = tiny_engine_factory(kv_cache_memory=10 * probe.runner.bytes_per_block)
    out = run(tight, {"forked": (prompt, params), "rival": (rival, SamplingParams(temperature=0, max_tokens=4))})
    choices = out["forked"]
    assert choices[0] == [firsts[0]]  # choice 0 stopped on its first token
    assert [choices[i] for i in range(1, n)] == [alone[i] for i in range(1, n)]
    assert all(len(c) == 8 for c in choices[1:])
    assert tight.block_manager.usage == 0.0


def test_a_fork_from_a_sequence_without_blocks_is_refused():
    bm = BlockManager(8, 4)
    req = Request("r", None, [1, 2, 3, 4, 5], SamplingParams(n=2), 4)
    with pytest.raises(RuntimeError, match="no blocks"):
        bm.fork(req.seqs[0], req.seqs[1])


def test_forked_children_count_against_max_num_seqs(tiny_engine_factory):
    engine = tiny_engine_factory(max_num_seqs=4)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    for rid in ("a", "b"):
        engine.add_request(rid, [5, 6, 7, 8], params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 3  # one request's three sequences at a time, never 4 + forks


def test_n_larger_than_max_num_seqs_is_rejected(tiny_engine_factory):
    from pagekube.engine.llm_engine import RequestRejected

    engine = tiny_engine_factory(max_num_seqs=2)
    with pytest.raises(RequestRejected, match="max_num_seqs"):
        engine.add_request("x", [5, 6], SamplingParams(n=3))
