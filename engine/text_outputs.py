"""The server's text, made off the engine thread: token deltas from the engine become the outputs a request asked
for (DELTA or FINAL_ONLY), with incremental detokenization, stop strings and the stream hold-back, as vLLM v1's
frontend output processor does. AsyncEngine runs this on its detokenizer thread; the engine thread only samples.

A stop string ends its choice here: the text is cut, tokens past it are dropped, and the engine is told to finish
the sequence (it may have computed a token or two more by then; they are not reported). The offline `LLM` keeps
text on its own thread (engine/output_processor.py), where nothing else waits on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from pagekube.engine.detokenizer import find_stop, new_decode_stream, streamable_end
from pagekube.engine.outputs import CompletionOutput, RequestOutput
from pagekube.engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ChoiceText:
    """One choice (sequence) of a request, as the client sees it."""

    stream: DecodeStream | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    sent_tokens: int = 0
    sent_text: int = 0
    sent_finish: bool = False


@dataclass
class StopSeen:
    """A stop string ended choice `index`; the engine finishes it, keeping `num_output_tokens` tokens."""

    request_id: str
    index: int
    stop: str
    num_output_tokens: int


class RequestText:
    """Text state of one request, fed with the engine's token deltas in order."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.backend = getattr(tokenizer, "_tokenizer", None)
        self.choices = [ChoiceText(new_decode_stream(tokenizer, prompt_token_ids, params.skip_special_tokens))
                        for _ in range(params.n)]

    def apply(self, out: RequestOutput) -> tuple[RequestOutput | None, list[StopSeen]]:
        """Take one engine delta; returns the output to hand the client (None when there is nothing to say yet)
        and the stop strings found."""
        stops = []
        for o in out.outputs:
            choice = self.choices[o.index]
            if choice.finish_reason is not None:
                continue  # ended here by a stop string; the engine's late tokens are not reported
            for j, tok in enumerate(o.token_ids):
                choice.token_ids.append(tok)
                if o.logprobs is not None:
                    choice.logprobs.append(o.logprobs[j])
                delta = self._decode(choice, tok)
                if len(choice.token_ids) >= self.params.min_tokens and (stop := self._find_stop(choice, delta)):
                    choice.finish_reason, choice.stop_reason = "stop", stop
                    stops.append(StopSeen(out.request_id, o.index, stop, len(choice.token_ids)))
                    break
            else:
                if o.finish_reason is not None:
                    choice.finish_reason, choice.stop_reason = o.finish_reason, o.stop_reason
        finished = all(c.finish_reason is not None for c in self.choices)
        kind = self.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None, stops
        outs = [c for c in (self._output(i, kind == RequestOutputKind.DELTA) for i in range(len(self.choices))) if c]
        if kind == RequestOutputKind.DELTA and not outs and not finished:
            return None, stops
        return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, outs, finished, out.num_cached_tokens,
                             out.metrics), stops

    def _decode(self, choice: ChoiceText, tok: int) -> str:
        if choice.stream is not None:
            delta = choice.stream.step(self.backend, tok) or ""
        else:  # a slow tokenizer: decode the whole output again (rare; no Rust backend)
            full = self.tokenizer.decode(choice.token_ids, skip_special_tokens=self.params.skip_special_tokens)
            delta = "" if full.endswith("\ufffd") else full[len(choice.text):]
        choice.text += delta
        return delta

    def _find_stop(self, choice: ChoiceText, delta: str) -> str | None:
        hit = find_stop(choice.text, delta, self.params)
        if hit is None:
            return None
        choice.text, stop = hit
        return stop

    def _output(self, index: int, delta: bool) -> CompletionOutput | None:
        c = self.choices[index]
        end = streamable_end(c.text, self.params, c.finish_reason is not None)
        t0, k0 = (c.sent_text, c.sent_tokens) if delta else (0, 0)
        k1 = len(c.token_ids)
        if delta:
            if k1 == k0 and end <= t0 and (c.finish_reason is None or c.sent_finish):
                return None
            c.sent_text, c.sent_tokens, c.sent_finish = max(end, t0), k1, c.finish_reason is not None
        want_lp = self.params.logprobs is not None
        cumulative = sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs, strict=True)) if want_lp else None
        return CompletionOutput(index=index, text=c.text[t0:end] if end > t0 else "", token_ids=c.token_ids[k0:],
                                cumulative_logprob=cumulative,
                                logprobs=c.logprobs[k0:] if want_lp else None, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason)
