"""Incremental detokenization: text deltas that never end inside a multi-byte character, and stop strings."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from pagekube.engine.core.sequence import Sequence

CONTEXT_TOKENS = 5  # earlier tokens decoded along, so a token's leading space or merge decodes right


def new_decode_stream(tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> DecodeStream | None:
    """A `tokenizers` DecodeStream (one O(1) step per token) primed with the last prompt tokens, for a fast (Rust)
    tokenizer; None for others."""
    if not isinstance(getattr(tokenizer, "_tokenizer", None), Tokenizer):
        return None
    return DecodeStream(ids=prompt_token_ids[-CONTEXT_TOKENS:], skip_special_tokens=skip_special_tokens)


def start_detokenizer(seq: Sequence, tokenizer) -> None:
    """A fast tokenizer gets a DecodeStream; others fall back to the offset method (two decodes of a short window
    per token)."""
    seq.detok_read_offset = seq.num_prompt_tokens
    seq.detok_prefix_offset = max(0, seq.num_prompt_tokens - CONTEXT_TOKENS)
    seq.decode_stream = new_decode_stream(tokenizer, seq.token_ids[: seq.num_prompt_tokens],
                                          seq.request.params.skip_special_tokens)


def detokenize_incrementally(tokenizer, seq: Sequence, skip_special_tokens: bool = True) -> str:
    """Append what the newest token adds to `seq.output_text` and return it ("" while a character is incomplete)."""
    if seq.decode_stream is not None:
        delta = seq.decode_stream.step(tokenizer._tokenizer, seq.token_ids[-1]) or ""
        seq.output_text += delta
        return delta
    ids = seq.token_ids
    prefix = tokenizer.decode(ids[seq.detok_prefix_offset : seq.detok_read_offset], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[seq.detok_prefix_offset :], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    delta = full[len(prefix) :]
    seq.detok_prefix_offset = seq.detok_read_offset
    seq.detok_read_offset = len(ids)
    seq.output_text += delta
    return delta


def find_stop(text: str, delta: str, params) -> tuple[str, str] | None:
    """The earliest stop string that `delta` (the newest end of `text`) completes: (the text cut there, the stop
    string), or None. Only the window the new text can reach is searched."""
    if not params.stop or not delta:
        return None
    window_start = max(0, len(text) - len(delta) - params.max_stop_len + 1)
    hits = [(at, stop) for stop in params.stop if (at := text.find(stop, window_start)) >= 0]
    if not hits:
        return None
    at, stop = min(hits, key=lambda hit: hit[0])  # the first stop string listed wins a tie
    return text[: at + len(stop) if params.include_stop_str_in_output else at], stop


def find_stop_string(seq: Sequence, delta: str) -> str | None:
    """If a stop string now appears in the output, cut the text there and return it."""
    hit = find_stop(seq.output_text, delta, seq.request.params)
    if hit is None:
        return None
    seq.output_text, stop = hit
    return stop


def streamable_end(text: str, params, finished: bool) -> int:
    """Length of the text safe to show now: a tail that could still become a stop string is held back until it
    cannot."""
    if finished:
        return len(text)
    return max(0, len(text) - max(0, params.max_stop_len - 1))


def streamable_len(seq: Sequence) -> int:
    return streamable_end(seq.output_text, seq.request.params, seq.is_finished)
