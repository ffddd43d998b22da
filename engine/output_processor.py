"""OutputProcessor: what happens once a token is sampled. It joins its sequence (with the progress that produced
it: the scheduler's append_token), then its text, grammar and stop checks run, finished requests are finalized,
and outputs are rendered as each request's output_kind asks."""

from __future__ import annotations

import logging
import time

from pagekube.engine.core.scheduler import Scheduler
from pagekube.engine.core.sequence import Request, Sequence
from pagekube.engine.detokenizer import detokenize_incrementally, find_stop_string, streamable_len
from pagekube.engine.outputs import CompletionOutput, RequestOutput
from pagekube.engine.sampling_params import RequestOutputKind

log = logging.getLogger("pagekube.engine")


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int, scheduler: Scheduler, sampler,
                 stat_listeners: list):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.sampler = sampler
        self.stat_listeners = stat_listeners  # the engine's own list: listeners added later are seen
        # Text here, on the engine's thread (offline), or off it (the server: engine/text_outputs.py, where stop
        # strings are found too; the engine then reports token deltas every step, whatever the output kind).
        self.inline_text = True

    def append_token(self, seq: Sequence, tok: int, logprob: float | None, top: dict[int, float] | None) -> None:
        """The token joins the sequence (with the progress that produced it), then its text, grammar and stop
        checks run. An error there is the request's own: it ends (aborted) and the batch goes on."""
        self.scheduler.append_token(seq, tok)
        try:
            self._process_token(seq, tok, logprob, top)
        except Exception:
            log.exception("request %s: processing token %d failed; aborting the request", seq.request.request_id, tok)
            if not seq.is_finished:
                self.finish_seq(seq, "abort", None)

    def _process_token(self, seq: Sequence, tok: int, logprob: float | None, top: dict[int, float] | None) -> None:
        req, p = seq.request, seq.request.params
        now = time.monotonic()
        m = req.metrics
        if seq.index == 0:
            if m.first_token_time is None:
                m.first_token_time = now
                for listener in self.stat_listeners:
                    listener.on_first_token(req)
            else:
                m.token_gaps.append(now - m.last_token_time)
            m.last_token_time = now
        if p.logprobs is not None:
            seq.cumulative_logprob += logprob
            seq.logprobs.append(top)
        delta = detokenize_incrementally(self.tokenizer, seq, p.skip_special_tokens) if self.inline_text else ""
        if seq.grammar is not None and not seq.grammar.accept_token(tok):
            # Only when other constraints left no token the grammar allows (e.g. min_tokens banning its stop token).
            log.warning("request %s: token %d is outside its grammar; finishing it", req.request_id, tok)
            self.finish_seq(seq, "abort", None)
        elif seq.grammar is not None and seq.grammar.is_terminated():
            # The grammar's stop token came: ignore_eos cannot go on past a finished document.
            self.finish_seq(seq, "stop", None)
        elif tok in p.stop_token_ids and seq.num_output_tokens >= p.min_tokens:
            self.finish_seq(seq, "stop", tok)
        elif tok in self.eos_token_ids and not p.ignore_eos and seq.num_output_tokens >= p.min_tokens:
            self.finish_seq(seq, "stop", None)
        elif (self.inline_text and seq.num_output_tokens >= p.min_tokens
              and (stop := find_stop_string(seq, delta)) is not None):
            self.finish_seq(seq, "stop", stop)
        elif seq.num_output_tokens >= req.max_tokens or seq.num_tokens >= self.max_model_len:
            self.finish_seq(seq, "length", None)

    def finish_seq(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
        self.sampler.release(seq)

    def finalize(self, req: Request) -> None:
        req.metrics.finished_time = time.monotonic()
        for listener in self.stat_listeners:
            listener.on_request_finished(req)

    def wants_output(self, req: Request) -> bool:
        """Whether a step that touched the unfinished `req` reports it (FINAL_ONLY waits for the end, unless the
        text is made elsewhere: it needs every delta)."""
        return req.params.output_kind != RequestOutputKind.FINAL_ONLY or not self.inline_text

    def make_output(self, req: Request) -> RequestOutput:
        """The request's output as its params' output_kind asks: everything so far, or (DELTA, and always when
        the text is made elsewhere) only what is new since the last one, in O(new) work: the choices with new
        tokens or a finish not yet reported."""
        delta = req.params.output_kind == RequestOutputKind.DELTA or not self.inline_text
        outs = []
        for s in req.seqs:
            t0, k0 = (s.sent_text_len, s.sent_tokens) if delta else (0, 0)
            text_end = streamable_len(s)
            k1 = s.num_output_tokens
            if delta:
                if k1 == k0 and text_end == t0 and (s.finish_reason is None or s.sent_finish):
                    continue
                s.sent_text_len, s.sent_tokens, s.sent_finish = text_end, k1, s.finish_reason is not None
            outs.append(CompletionOutput(
                index=s.index,
                text=s.output_text[t0:text_end],
                token_ids=s.token_ids[s.num_prompt_tokens + k0:],
                cumulative_logprob=s.cumulative_logprob if req.params.logprobs is not None else None,
                logprobs=s.logprobs[k0:] if req.params.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            ))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.is_finished,
                             req.seqs[0].num_cached_tokens, req.metrics)
