"""Does a request's greedy output depend on what else runs? The bundled model in the default dtype (bf16 where the
CPU has AVX512_BF16), 12 prompts (not the tests' own) x 48 tokens: each alone, then as a batch of 12, in a batch
with 20 others, with n-gram speculation, after a prefix-cache hit and (--tp) under tensor parallelism; prints how
many of the 12 equal the prompt alone, and how many pass vLLM's check_logprobs_close rule against transformers in
float32 (at the first token where they part, each one is in the other's top 5). Run it with VLLM_BATCH_INVARIANT=0
to see the faster, batch-dependent dispatch.

    .venv/bin/python bench/batch_invariance.py --tp 3
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekube.engine import LLM, SamplingParams  # noqa: E402
from pagekube.engine.model.model_files import resolve_model_dir  # noqa: E402
from tests.logprobs_rule import hf_greedy, parting  # noqa: E402  (the rule the tests apply)

QUESTIONS = ["What is the capital of Australia?", "Write a short poem about the sea.", "How do vaccines work?",
             "Name three primary colors.", "What is a prime number?", "Describe a cat in two sentences.",
             "How many legs does a spider have?", "What causes the seasons on Earth?",
             "Give two tips for better sleep.", "What is the speed of light?", "Explain recursion simply.",
             "Why do leaves change color in the fall?"]
OTHERS = [f"Count from {i} to {i + 5} in words." for i in range(20)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params)]


def agree(got: list, alone: list) -> int:
    return sum(a.token_ids == b.token_ids for a, b in zip(got, alone, strict=True))


def hf_rule(model_dir, prompts, ours, tokens: int) -> int:
    """How many outputs pass check_logprobs_close against transformers' float32 greedy output."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return sum(parting(out, *hf_greedy(hf, ids, tokens)) is None for ids, out in zip(prompts, ours, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--tp", type=int, default=0, help="also run under this tensor-parallel size")
    ap.add_argument("--smoke", action="store_true", help="3 prompts, 8 tokens, no transformers (the script works)")
    args = ap.parse_args()
    questions, others = (QUESTIONS[:3], OTHERS[:4]) if args.smoke else (QUESTIONS, OTHERS)
    tokens = 8 if args.smoke else args.tokens
    model_dir = resolve_model_dir(None)
    greedy = SamplingParams(temperature=0, max_tokens=tokens, logprobs=5)
    kwargs = {"kv_cache_memory": 256 * 1024**2}
    llm = LLM(str(model_dir), enable_prefix_caching=False, **kwargs)
    n = len(questions)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions + others]
    print(f"dtype {llm.engine.config.dtype}, kernels {llm.engine.runner.kernels.names}, "
          f"VLLM_BATCH_INVARIANT={os.environ.get('VLLM_BATCH_INVARIANT', '1')}")
    alone = [outputs(llm, [p], greedy)[0] for p in prompts[:n]]
    runs = {f"batch of {n}": outputs(llm, prompts[:n], greedy)}
    half = len(others) // 2
    runs[f"batch with {len(others)} others"] = outputs(llm, prompts[n:n + half] + prompts[:n] + prompts[n + half:], greedy)[half:half + n]
    llm.close()
    llm = LLM(str(model_dir), speculative_config=NGRAM, **kwargs)
    runs["n-gram speculation"] = outputs(llm, prompts[:n], greedy)
    llm.close()
    llm = LLM(str(model_dir), **kwargs)
    for p in prompts[:n]:
        outputs(llm, [p], greedy)
    runs["prefix-cache hit"] = [outputs(llm, [p], greedy)[0] for p in prompts[:n]]
    llm.close()
    print(f"| run | equal to alone (of {n}) |\n|---|---|")
    for name, got in runs.items():
        print(f"| {name} | {agree(got, alone)} |")
    if args.tp:  # the ranks' partial sums of o_proj and down_proj add up in another order than one process's
        llm = LLM(str(model_dir), tensor_parallel_size=args.tp, enable_prefix_caching=False, **kwargs)
        tp_alone = [outputs(llm, [p], greedy)[0] for p in prompts[:n]]
        tp_batch = outputs(llm, prompts[:n], greedy)
        llm.close()
        print(f"| TP={args.tp} alone | {agree(tp_alone, alone)} |")
        print(f"| TP={args.tp} batch of {n}, against TP={args.tp} alone | {agree(tp_batch, tp_alone)} |")
    if not args.smoke:
        print(f"alone vs transformers float32, check_logprobs_close: {hf_rule(model_dir, prompts[:n], alone, tokens)}"
              f" of {n} pass")


if __name__ == "__main__":
    main()
