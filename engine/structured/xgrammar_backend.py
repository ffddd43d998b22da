"""The xgrammar backend (vLLM's default): compiled grammars, per-sequence matchers, batched bitmasks.

Chosen over llguidance because it is what vLLM users' requests were written against (its JSON-schema dialect
and EBNF), it fills a batch's bitmasks in one multi-threaded call, and it applies them with a CPU or GPU kernel.
"""

from __future__ import annotations

import json
import os
import re

import torch
import xgrammar as xgr

from pagekube.engine.sampling_params import StructuredOutputsParams
from pagekube.engine.structured import GrammarError

_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[16:00:33] /project/cpp/x.cc:94: " before the reason


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string literals are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        threads = max(1, min(8, os.cpu_count() or 1))
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self.vocab_size = vocab_size

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        try:
            if params.json_object:  # OpenAI's json_object is an object; xgrammar's builtin JSON is any value
                return self.compiler.compile_json_schema('{"type": "object"}')
            if params.json is not None:
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                return self.compiler.compile_json_schema(schema)
            if params.regex is not None:
                return self.compiler.compile_regex(params.regex)
            if params.choice is not None:
                return self.compiler.compile_grammar(choice_grammar(params.choice))
            return self.compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as e:  # xgrammar reports every compile error as one of these
            raise GrammarError(_LOCATION.sub("", str(e).strip())) from e

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)

    def mask_logits(self, logits: torch.Tensor, rows: list[int], matchers: list[xgr.GrammarMatcher]) -> None:
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        bitmask = bitmask.to(logits.device, non_blocking=True)
        if len(rows) == logits.shape[0]:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
        else:
            picked = logits[rows]
            xgr.apply_token_bitmask_inplace(picked, bitmask, vocab_size=self.vocab_size)
            logits[rows] = picked
