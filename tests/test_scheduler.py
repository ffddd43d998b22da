"""Scheduler: token budget, chunked prefill mixed with decodes, preemption by recompute, admission limits."""

from __future__ import annotations

import random

import pytest

from pagekube.engine import SamplingParams
from pagekube.engine.core.block_manager import BlockManager
from pagekube.engine.core.scheduler import Scheduler
from pagekube.engine.core.sequence import Request
from pagekube.engine.llm_engine import LLMEngine, RequestRejected


def make_seq(rid: str, n_tokens: int):
    return Request(rid, None, [1 + i % 50 for i in range(n_tokens)], SamplingParams(max_tokens=4), 4).seqs[0]


def run_step(batch) -> None:
    """Pretend the model ran: tokens computed, and a sequence that finished its prompt samples one token."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)


def test_token_budget_and_max_num_seqs_hold_on_every_step():
    rng = random.Random(0)
    sched = Scheduler(BlockManager(400, 16), max_num_seqs=5, max_num_batched_tokens=64)
    for i in range(20):
        sched.add(make_seq(str(i), rng.randint(1, 150)))
    mixed = False
    for _ in range(300):
        batch = sched.schedule()
        if not batch:
            break
        assert batch.num_batched_tokens <= 64
        assert len(sched.running) <= 5 and len(batch.seqs) <= 5
        decodes = sum(1 for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq.num_output_tokens and n == 1)
        mixed |= decodes > 0 and any(n > 1 for n in batch.num_new_tokens)
        run_step(batch)
        for seq in list(sched.running):
            if seq.num_output_tokens >= 3:
                sched.finish(seq)
    assert not sched.has_work()
    assert mixed, "prefill chunks and decodes never shared a step"


def test_long_prompt_is_chunked_while_a_stream_keeps_decoding():
    sched = Scheduler(BlockManager(100, 16), max_num_seqs=8, max_num_batched_tokens=32)
    streaming = make_seq("s", 5)
    sched.add(streaming)
    run_step(sched.schedule())
    sched.add(make_seq("long", 200))
    for _ in range(5):
        batch = sched.schedule()
        assert batch.seqs[0] is streaming and batch.num_new_tokens[0] == 1  # decode first, every step
        assert batch.num_new_tokens[1] == 31  # the rest of the budget goes to the long prompt's next chunk
        run_step(batch)


def test_newest_running_sequence_is_preempted_and_requeued_first():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=64)
    old, new = make_seq("old", 7), make_seq("new", 7)
    sched.add(old)
    sched.add(new)
    run_step(sched.schedule())  # 2 blocks each: the pool is full
    for _ in range(2):
        batch = sched.schedule()
        run_step(batch)
    assert sched.num_preemptions >= 1
    assert new.request.num_preemptions >= 1 and old.request.num_preemptions == 0
    assert new in sched.waiting and new.num_computed_tokens == 0 and new.block_table == []


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def test_preemption_by_recompute_leaves_greedy_output_unchanged(tiny_engine_factory):
    rng = random.Random(1)
    prompts = [[rng.randrange(49152) for _ in range(rng.randint(20, 60))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = tiny_engine_factory()
    expected = generate(roomy, prompts, params)
    assert roomy.scheduler.num_preemptions == 0
    tight = tiny_engine_factory(kv_cache_memory=20 * roomy.runner.bytes_per_block)  # 20 blocks for ~600 tokens
    assert generate(tight, prompts, params) == expected
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.usage == 0.0



def test_requests_that_can_never_fit_are_rejected_with_the_limit_named(tiny_engine_factory):
    engine = tiny_engine_factory(max_model_len=64, kv_cache_memory=2 * 1024 * 1024)
    with pytest.raises(RequestRejected, match="max_model_len"):
        engine.add_request("a", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match="max_model_len"):
        engine.add_request("b", [5] * 64, SamplingParams(max_tokens=None))
    small = tiny_engine_factory(kv_cache_memory=3 * engine.runner.bytes_per_block)
    with pytest.raises(RequestRejected, match="kv_cache_memory"):
        small.add_request("c", [5] * 40, SamplingParams(max_tokens=20))
    assert not small.has_unfinished_requests()


def test_kv_fragmentation_stays_low_on_a_mixed_workload(tiny_engine_factory):
    rng = random.Random(2)
    engine = tiny_engine_factory(block_size=16)
    for i in range(24):
        prompt = [rng.randrange(49152) for _ in range(rng.randint(150, 700))]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=rng.randint(4, 40), ignore_eos=True))
    worst = 1.0
    while engine.has_unfinished_requests():
        engine.step()
        if engine.scheduler.running:
            worst = max(worst, engine.kv_fragmentation())
    assert 1.0 <= worst <= 1.04


class TokenCounter:
    """A StatListener that records how many tokens each step computed."""

    def __init__(self):
        self.steps: list[int] = []

    def on_iteration(self, engine, num_tokens, num_generated, num_preemptions):
        self.steps.append(num_tokens)

    def on_first_token(self, request):
        pass

    def on_request_finished(self, request):
        pass

    def refresh(self, engine):
        pass


def test_prefix_cache_computes_only_the_suffix_and_output_is_unchanged(tiny_engine_factory):
    rng = random.Random(3)
    prefix = [rng.randrange(49152) for _ in range(1000)]
    first = prefix + [rng.randrange(49152) for _ in range(20)]
    second = prefix + [rng.randrange(49152) for _ in range(37)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    uncached = tiny_engine_factory(enable_prefix_caching=False)
    expected = generate(uncached, [second], params)[0]
    engine = tiny_engine_factory()
    generate(engine, [first], params)
    counter = TokenCounter()
    engine.stat_listeners = [counter]
    engine.add_request("second", second, params)
    done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            done = out if out.finished else done
    cached = (1000 // 16) * 16  # full blocks of the shared prefix: 992 tokens
    assert done.num_cached_tokens == cached
    assert sum(counter.steps) == (len(second) - cached) + (8 - 1)  # the suffix, then 7 decode steps
    assert done.outputs[0].token_ids == expected


def test_a_request_finishing_in_its_prefill_step_leaves_its_prompt_blocks_cached(tiny_engine_factory):
    """max_tokens=1: the step that computes the prompt also finishes the request. Its full blocks are registered
    before they are freed, so the same prompt again is served from the prefix cache."""
    engine = tiny_engine_factory()
    prompt = [100 + i for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=1)
    outs = []
    for rid in ("first", "again"):
        engine.add_request(rid, prompt, params)
        outs += [out for out in engine.step() if out.finished]
    assert [o.num_cached_tokens for o in outs] == [0, 32]  # two full 16-token blocks; the last token is computed
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
