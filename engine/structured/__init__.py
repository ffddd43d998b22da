"""Structured outputs: constrain a sequence's tokens to a JSON schema, a regex, a choice or a grammar.

One small interface (GrammarBackend) so another library could sit behind it; xgrammar (vLLM's default backend)
is the one built. Per step the engine asks the backend to fill one token bitmask for every constrained row in one
batched call and applies it to those rows of the logits, on their device, before sampling; unconstrained rows pay
nothing. Compilation happens in prepare_request (the tokenizer thread, off the engine loop) and is cached by the
grammar's text, so a schema sent a thousand times compiles once.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagekube.engine.sampling_params import StructuredOutputsParams

DEFAULT_GRAMMAR_BACKEND = "xgrammar"


class GrammarError(ValueError):
    """The grammar, schema or regex does not compile; the message says why."""


class GrammarMatcher(Protocol):
    """One sequence's position in its grammar."""

    def accept_token(self, token_id: int) -> bool: ...
    def is_terminated(self) -> bool: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, params: StructuredOutputsParams) -> object:
        """A compiled grammar (cached); GrammarError when it cannot be compiled."""

    def matcher(self, compiled: object) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""

    def mask_logits(self, logits: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher]) -> None:
        """Set to -inf, in place, every token that `matchers[i]` does not allow next in row `rows[i]`."""


def make_grammar_backend(name: str, tokenizer, vocab_size: int, stop_token_ids: set[int]) -> GrammarBackend:
    if name == "xgrammar":
        from pagekube.engine.structured.xgrammar_backend import (
            XgrammarBackend,  # imports torch kernels: lazily
        )

        return XgrammarBackend(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"unknown structured outputs backend {name!r} (available: xgrammar)")
