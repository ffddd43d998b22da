"""Greedy output in the default dtype (bf16) does not depend on the batch: a request alone, in a batch of twelve, in a
batch with twenty others, with n-gram speculation and after a prefix-cache hit gives the same tokens, because every
row's linears add up in one order (AMX tiles, or the AVX-512 kernels' dot_order.h) and a generated token's attention
goes through the decode kernel, whatever the step holds (docs/architecture.md, "Batch invariance"). Each output also
passes vLLM's check_logprobs_close rule against transformers in float32: at the first token where they part, each
one is in the other's top 5."""

import pytest

from pagekube.engine import LLM, SamplingParams
from pagekube.kernels import cpu_ops
from tests.logprobs_rule import hf_greedy, parting

pytestmark = pytest.mark.skipif(not cpu_ops.cpu_supports_bf16_dot(),
                                reason="bf16 is the default dtype only with AVX512_BF16 (docs/architecture.md)")

QUESTIONS = ["Write a haiku about autumn leaves.", "Explain what a Kubernetes pod is.", "List three uses of copper.",
             "What is the boiling point of water in Fahrenheit?", "Give me a recipe for pancakes.",
             "Who wrote Pride and Prejudice?", "Translate 'good morning' into Spanish.",
             "Describe the water cycle briefly.", "What does HTTP stand for?", "Suggest a name for a pet turtle.",
             "Summarize the plot of Romeo and Juliet.", "Why is the sky blue?"]
OTHERS = [f"Tell me a fact about the number {i}." for i in range(20)]
TOKENS = 40
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, logprobs=5)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def engine(bundled_dir, **kwargs) -> LLM:
    return LLM(str(bundled_dir), dtype="bfloat16", kv_cache_memory=256 * 1024**2, **kwargs)


@pytest.fixture(scope="module")
def plain(bundled_dir):
    llm = engine(bundled_dir, enable_prefix_caching=False)
    assert "batch_invariant" in llm.engine.runner.kernels.names
    return llm


@pytest.fixture(scope="module")
def prompts(plain):
    return [plain.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS + OTHERS]


@pytest.fixture(scope="module")
def alone(plain, prompts):
    return [plain.generate([p], GREEDY)[0].outputs[0] for p in prompts[:12]]


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def agree(got, alone) -> int:
    return sum(a == b for a, b in zip(tokens(got), tokens(alone), strict=True))


def test_a_batch_of_twelve_and_a_batch_with_twenty_others_change_no_output(plain, prompts, alone):
    batch = [o.outputs[0] for o in plain.generate(prompts[:12], GREEDY)]
    crowd = [o.outputs[0] for o in plain.generate(prompts[12:22] + prompts[:12] + prompts[22:], GREEDY)][10:22]
    assert agree(batch, alone) >= 11 and agree(crowd, alone) >= 11, (agree(batch, alone), agree(crowd, alone))


def test_ngram_speculation_changes_no_output(bundled_dir, prompts, alone):
    llm = engine(bundled_dir, speculative_config=NGRAM)
    try:
        outputs = [o.outputs[0] for o in llm.generate(prompts[:12], GREEDY)]
        accepted = llm.engine.speculator.stats.num_accepted_tokens
    finally:
        llm.close()
    assert accepted > 0 and agree(outputs, alone) >= 11, (accepted, agree(outputs, alone))


def test_a_prefix_cache_hit_changes_no_output(bundled_dir, prompts, alone):
    llm = engine(bundled_dir)
    first = [llm.generate([p], GREEDY)[0].outputs[0] for p in prompts[:12]]
    again = [llm.generate([p], GREEDY)[0].outputs[0] for p in prompts[:12]]
    hits = llm.engine.block_manager.prefix_cache_hits
    assert hits > 0 and agree(first, alone) >= 11 and agree(again, alone) >= 11, (hits, agree(again, alone))


def test_each_output_is_close_to_transformers_float32_by_vllms_rule(hf_model, prompts, alone):
    for ids, ours in zip(prompts[:12], alone, strict=True):
        assert parting(ours, *hf_greedy(hf_model, ids, TOKENS)) is None, ids


def test_under_tensor_parallelism_output_does_not_depend_on_the_batch(bundled_dir, prompts):
    """Each rank's linears add in one order, and the all-reduce adds the ranks' parts in rank order whatever the
    tensor's size (gloo's ring would cut it into chunks by size)."""
    llm = engine(bundled_dir, tensor_parallel_size=3, enable_prefix_caching=False)
    try:
        alone = [llm.generate([p], GREEDY)[0].outputs[0] for p in prompts[:8]]
        batch = [o.outputs[0] for o in llm.generate(prompts[:8], GREEDY)]
    finally:
        llm.close()
    assert agree(batch, alone) == 8, agree(batch, alone)
