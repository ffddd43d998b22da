"""One structured log line per finished request, streamed or not: the engine calls it when a request ends."""

from __future__ import annotations

import logging

from pagekube.engine.core.sequence import Request

log = logging.getLogger("pagekube.requests")


def _seconds(start: float | None, end: float | None) -> float | None:
    return round(end - start, 4) if start is not None and end is not None else None


class RequestLogger:
    """A StatListener that only listens for finished requests. Prompt text only with --enable-log-prompts."""

    def __init__(self, model_name: str, log_prompts: bool = False):
        self.model_name = model_name
        self.log_prompts = log_prompts

    def on_request_finished(self, req: Request) -> None:
        m = req.metrics
        record = {"event": "request_finished", "id": req.request_id, "model": self.model_name,
                  **({"lora_adapter": req.lora.name} if req.lora is not None else {}),
                  "finish_reason": [s.finish_reason for s in req.seqs] if len(req.seqs) > 1 else req.finish_reason,
                  "prompt_tokens": len(req.prompt_token_ids),
                  "output_tokens": sum(s.num_output_tokens for s in req.seqs),
                  "cached_tokens": req.seqs[0].num_cached_tokens, "preemptions": req.num_preemptions,
                  "queue_s": _seconds(m.arrival_time, m.first_scheduled_time),
                  "ttft_s": _seconds(m.arrival_time, m.first_token_time),
                  "e2e_s": _seconds(m.arrival_time, m.finished_time)}
        if self.log_prompts:
            record["prompt"] = req.prompt if req.prompt is not None else req.prompt_token_ids
        log.info(record)

    def on_pooled_request(self, job) -> None:
        record = {"event": "request_finished", "id": job.request_id, "model": self.model_name,
                  "finish_reason": job.finish_reason, "inputs": len(job.prompts),
                  "prompt_tokens": sum(len(p) for p in job.prompts),
                  "queue_s": _seconds(job.arrival_time, job.first_scheduled_time),
                  "e2e_s": _seconds(job.arrival_time, job.finished_time)}
        if self.log_prompts:
            record["prompt"] = job.prompts
        log.info(record)

    def on_pooling_iteration(self, engine, num_tokens: int) -> None:
        pass

    def on_iteration(self, engine, num_tokens: int, num_generated: int, num_preemptions: int) -> None:
        pass

    def on_first_token(self, request: Request) -> None:
        pass

    def refresh(self, engine) -> None:
        pass
