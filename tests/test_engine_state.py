"""Engine state survives interruption: a step that raises (sampler error, Ctrl-C) or a request whose output
processing fails leaves every other sequence consistent, and the next run gives exactly what a fresh engine gives.
Faults are injected where they would hit: between the forward and the token being appended. Float32, so outputs
compare exactly."""

from __future__ import annotations

import pytest

from pagekube.engine import LLM, SamplingParams
from pagekube.engine.sampling_params import RequestOutputKind

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22] * 13, [30, 31, 32, 33] * 3, [40 + i for i in range(50)]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def run_to_end(engine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
    return done


def add_all(engine) -> None:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)


class FailOnce:
    """Wraps the sampler: the `nth` call raises `exc` (later calls sample normally)."""

    def __init__(self, sampler, nth: int, exc: BaseException):
        self.sampler, self.nth, self.exc, self.calls = sampler, nth, exc, 0

    def __call__(self, logits, seqs):
        self.calls += 1
        if self.calls == self.nth:
            raise self.exc
        return self.sampler(logits, seqs)

    def __getattr__(self, name):
        return getattr(self.sampler, name)


@pytest.mark.parametrize("speculative", [None, SPECULATIVE], ids=["plain", "ngram"])
@pytest.mark.parametrize("nth", [1, 3, 6])
def test_a_step_that_raises_in_the_sampler_is_recomputed_by_the_next(tiny_engine_factory, speculative, nth):
    kw = {"max_num_batched_tokens": 32, "speculative_config": speculative}
    fresh = tiny_engine_factory(**kw)
    add_all(fresh)
    expected = run_to_end(fresh)

    engine = tiny_engine_factory(**kw)
    add_all(engine)
    engine.sampler = FailOnce(engine.sampler, nth, RuntimeError("injected sampler fault"))
    with pytest.raises(RuntimeError, match="injected"):
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.has_unfinished_requests()  # the step failed; its requests wait to be recomputed
    assert run_to_end(engine) == expected


def test_an_interrupted_generate_aborts_its_requests_and_the_next_matches_a_fresh_llm(tiny_dir):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(tiny_dir), dtype="float32").generate(prompts, params)]

    llm = LLM(str(tiny_dir), dtype="float32", max_num_batched_tokens=32)
    sampler = llm.engine.sampler
    llm.engine.sampler = FailOnce(sampler, 4, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.scheduler.has_work() and llm.engine.block_manager.usage == 0.0
    llm.engine.sampler = sampler
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected


class ExplodingMatcher:
    """A structured-outputs matcher that fails on its second token."""

    def __init__(self):
        self.tokens = 0

    def accept_token(self, token: int) -> bool:
        self.tokens += 1
        if self.tokens == 2:
            raise RuntimeError("injected matcher fault")
        return True

    def is_terminated(self) -> bool:
        return False


def test_an_error_in_one_requests_output_processing_ends_only_that_request(tiny_engine_factory):
    fresh = tiny_engine_factory()
    add_all(fresh)
    expected = run_to_end(fresh)

    engine = tiny_engine_factory()
    add_all(engine)
    engine.requests["1"].seqs[0].grammar = ExplodingMatcher()  # after the sampler's mask: only accept_token runs
    engine.sampler.grammar_backend = type("NoMask", (), {"mask_logits": lambda *a: None})()
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out.outputs[0]
    assert finals["1"].finish_reason == "abort" and len(finals["1"].token_ids) == 2
    assert {rid: o.token_ids for rid, o in finals.items() if rid != "1"} == {
        rid: t for rid, t in expected.items() if rid != "1"}
    assert engine.block_manager.usage == 0.0


def test_engine_state_is_touched_only_by_its_owner_thread(tiny_engine_factory):
    import threading

    engine = tiny_engine_factory()
    engine.add_request("a", PROMPTS[0], GREEDY)  # this thread owns the engine now
    errors = []

    def intruder():
        for call in (engine.step, lambda: engine.abort_request("a"), lambda: engine.add_request("b", [1, 2], GREEDY)):
            try:
                call()
            except RuntimeError as e:
                errors.append(str(e))
    t = threading.Thread(target=intruder, name="intruder")
    t.start()
    t.join()
    assert len(errors) == 3 and all("'intruder'" in e for e in errors)
    assert run_to_end(engine)["a"]  # the owner goes on undisturbed
