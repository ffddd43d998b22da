"""Rendering engine outputs as OpenAI responses: whole responses, SSE chunk streams, usage and logprobs."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagekube.engine.async_engine import AsyncEngine, RequestStream
from pagekube.engine.errors import EngineDeadError
from pagekube.engine.outputs import RequestOutput
from pagekube.engine.server.errors import APIError, error_body
from pagekube.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from pagekube.engine.tool_calls import ToolReply

log = logging.getLogger("pagekube.server")


async def collect(streams: list[RequestStream], request: Request) -> list[RequestOutput]:
    """Wait for every stream to finish; a client that hangs up aborts them (and frees their blocks)."""
    task = asyncio.ensure_future(asyncio.gather(*(s.final() for s in streams)))
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            try:
                return task.result()
            except EngineDeadError as e:
                raise APIError(503, str(e), code="engine_dead") from e
        if await request.is_disconnected():
            task.cancel()
            for s in streams:
                s.engine.abort(s.request_id)
            raise APIError(499, "client disconnected")


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index. A stream that fails fails the
    whole merge (its exception is raised here), so nobody waits for a pump that died."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                await q.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out = await q.get()
            if isinstance(out, BaseException):
                raise out
            if out.finished:
                remaining -= 1
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


def sse(chunks: AsyncIterator[dict], streams: list[RequestStream]) -> StreamingResponse:
    """SSE `data:` events ending with `data: [DONE]`. A failure mid-stream (engine loop dead, anything raised)
    becomes one error event in the OpenAI error shape, then [DONE]: the client is told, never left hanging."""

    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except EngineDeadError as e:
            yield f"data: {json.dumps(error_body(503, str(e), code='engine_dead'))}\n\n"
        except Exception as e:  # noqa: BLE001
            log.exception("stream failed")
            yield f"data: {json.dumps(error_body(500, f'internal error: {type(e).__name__}'))}\n\n"
        finally:
            for s in streams:  # no-op for finished ones; aborts the rest when the client is gone
                s.engine.abort(s.request_id)
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@dataclass
class Usage:
    """Token counts of one API response, summed over its engine requests."""

    prompt: int = 0
    completion: int = 0
    cached: int = 0

    @classmethod
    def of(cls, finals: list[RequestOutput]) -> Usage:
        u = cls()
        for f in finals:
            u.add_request(f)
            u.completion += sum(len(o.token_ids) for o in f.outputs)
        return u

    def add_request(self, out: RequestOutput) -> None:
        self.prompt += len(out.prompt_token_ids)
        self.cached += out.num_cached_tokens

    def as_dict(self) -> dict:
        """The OpenAI `usage` object."""
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion, "prompt_tokens_details": {"cached_tokens": self.cached}}


def served_name(state, body) -> str:
    """The name responses carry: the LoRA adapter the request named, or the base model's."""
    return body.model or state.model_name


async def completion_chunks(state, body: CompletionRequest, rid: str, streams) -> AsyncIterator[dict]:
    """Each engine output is a delta: new text, new token ids, new logprobs, a finish reason reported once."""
    eng, created, counts, echoed = state.engine, int(time.time()), Usage(), set()
    async for i, out in merged(streams):
        for o in out.outputs:
            counts.completion += len(o.token_ids)
            text = o.text
            if body.echo and (i, o.index) not in echoed:  # the prompt goes first, once per choice
                echoed.add((i, o.index))
                text = prompt_text(eng, out) + text
            yield {"id": rid, "object": "text_completion", "created": created, "model": served_name(state, body),
                   "choices": [{"index": i * body.n + o.index, "text": text, "finish_reason": o.finish_reason,
                                "stop_reason": o.stop_reason,
                                "logprobs": await completion_logprobs(eng, o.token_ids, o.logprobs) if body.logprobs is not None else None}]}
        if out.finished:
            counts.add_request(out)
    if body.stream_options and body.stream_options.include_usage:
        yield {"id": rid, "object": "text_completion", "created": created, "model": served_name(state, body),
               "choices": [],
               "usage": counts.as_dict()}


async def chat_chunks(state, body: ChatCompletionRequest, rid: str, stream: RequestStream,
                      reply: ToolReply | None = None) -> AsyncIterator[dict]:
    eng, created, counts = state.engine, int(time.time()), Usage()
    replies = {i: reply.fresh() for i in range(body.n)} if reply is not None else None

    def chunk(choices):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": served_name(state, body),
                "choices": choices}

    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for i in range(body.n)])
    async for out in stream:
        for o in out.outputs:
            counts.completion += len(o.token_ids)
            logprobs = await chat_logprobs(eng, o.token_ids, o.logprobs, body.top_logprobs or 0) if body.logprobs else None
            if replies is None:
                yield chunk([{"index": o.index, "delta": {"content": o.text} if o.text else {}, "logprobs": logprobs,
                              "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}])
                continue
            # Tool calls: the text becomes content and/or tool_calls deltas; the finish reason comes last.
            r = replies[o.index]
            deltas = r.delta(o.text) if o.text else []
            finish = None
            if o.finish_reason is not None:
                more, finish = r.finish(o.finish_reason)
                deltas += more
            for j, d in enumerate(deltas or ([{}] if logprobs else [])):
                yield chunk([{"index": o.index, "delta": d, "logprobs": logprobs if j == 0 else None, "finish_reason": None}])
            if finish is not None:
                yield chunk([{"index": o.index, "delta": {}, "logprobs": None, "finish_reason": finish,
                              "stop_reason": o.stop_reason}])
        if out.finished:
            counts.add_request(out)
    if body.stream_options and body.stream_options.include_usage:
        c = chunk([])
        c["usage"] = counts.as_dict()
        yield c


# ---- response pieces ---------------------------------------------------------------------------------------------
def prompt_text(eng: AsyncEngine, out: RequestOutput) -> str:
    """The prompt as text, for `echo` (a token-id prompt is decoded)."""
    return out.prompt or eng.engine.tokenizer.decode(out.prompt_token_ids)


def token_strings(tokenizer, ids: set[int]) -> dict[int, str]:
    """Each token id as text, decoded alone (vLLM's logprobs tokens), in one batch call."""
    ordered = sorted(ids)
    return dict(zip(ordered, tokenizer.batch_decode([[t] for t in ordered]), strict=True))


async def _strings(eng: AsyncEngine, token_ids: list[int], logprobs: list[dict]) -> dict[int, str]:
    """The strings of the sampled tokens and their alternatives, decoded on the tokenizer thread (a step's worth
    of top-k alternatives would otherwise be decoded one by one on the event loop, stalling every stream)."""
    ids = set(token_ids)
    for lp in logprobs:
        ids.update(lp)
    return await eng.run_tokenizer(token_strings, eng.engine.tokenizer, ids)


async def completion_logprobs(eng: AsyncEngine, token_ids: list[int], logprobs: list[dict] | None) -> dict:
    pairs = list(zip(token_ids, logprobs or [], strict=False))
    text = await _strings(eng, [t for t, _ in pairs], [lp for _, lp in pairs])
    tokens, lps, tops = [], [], []
    for tok, lp in pairs:
        tokens.append(text[tok])
        lps.append(lp[tok])
        tops.append({text[t]: v for t, v in lp.items()})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": []}


async def chat_logprobs(eng: AsyncEngine, token_ids: list[int], logprobs: list[dict] | None, top_k: int) -> dict:
    pairs = list(zip(token_ids, logprobs or [], strict=False))
    text = await _strings(eng, [t for t, _ in pairs], [lp for _, lp in pairs])
    content = []
    for tok, lp in pairs:
        s = text[tok]
        top = sorted(lp.items(), key=lambda x: -x[1])[:top_k]
        content.append({"token": s, "logprob": lp[tok], "bytes": list(s.encode()),
                        "top_logprobs": [{"token": text[t], "logprob": v, "bytes": list(text[t].encode())}
                                         for t, v in top]})
    return {"content": content}
