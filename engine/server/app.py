"""FastAPI app: OpenAI-compatible endpoints over the AsyncEngine, health, metrics and drain-aware admission."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagekube
from pagekube.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from pagekube.engine.config import EngineConfig
from pagekube.engine.llm_engine import RequestRejected
from pagekube.engine.outputs import CompletionOutput, RequestOutput
from pagekube.engine.server.errors import APIError, error_response
from pagekube.engine.server.metrics import EngineMetrics
from pagekube.engine.server.middleware import GuardMiddleware
from pagekube.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)

request_log = logging.getLogger("pagekube.requests")


@dataclass
class ServerState:
    config: EngineConfig
    engine: AsyncEngine | None = None
    metrics: EngineMetrics | None = None
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.engine.engine.served_model_name

    @property
    def healthy(self) -> bool:
        return self.engine is not None and not self.draining and self.engine.dead is None


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="pagekube", version=pagekube.__version__)
    app.state.pk = state
    app.add_middleware(GuardMiddleware, api_key=state.config.api_key, max_body_bytes=state.config.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        msg = err.get("msg", "invalid request")
        if err.get("type") == "json_invalid":
            msg = "the request body is not valid JSON"
        return error_response(400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}", param=".".join(loc) or None,
                              code="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(APIError)
    async def _api(_, exc: APIError):
        return exc.response()

    @app.exception_handler(Exception)
    async def _unexpected(_, exc: Exception):
        logging.getLogger("pagekube.server").exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}")

    # ---- open endpoints ---------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if state.healthy:
            return Response(status_code=200)
        reason = "draining" if state.draining else ("loading" if state.engine is None else "engine dead")
        return error_response(503, f"not ready: {reason}", code=reason.replace(" ", "_"))

    @app.get("/ping")
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": pagekube.__version__}

    @app.get("/metrics")
    async def metrics():
        if state.metrics is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        state.metrics.draining.set(1 if state.draining else 0)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- OpenAI API -------------------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        eng = require_engine(state)
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "pagekube",
            "root": str(eng.engine.model_dir), "max_model_len": eng.engine.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        eng = require_engine(state)
        check_model(state, body.model)
        tok = eng.engine.tokenizer
        if body.messages:
            ids = chat_prompt_ids(eng, body.messages, True)
        elif body.prompt is not None:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        return {"count": len(ids), "max_model_len": eng.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        eng = require_engine(state)
        check_model(state, body.model)
        vocab = len(eng.engine.tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": eng.engine.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        eng = admit(state, body)
        params = build_params(body, body.max_tokens if body.max_tokens is not None else 16, body.logprobs)
        prompts = body.prompts()
        streams = start_streams(eng, prompts, params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return sse(completion_chunks(state, body, rid, streams), streams)
        finals = await collect(streams, request)
        choices = []
        for i, out in enumerate(finals):
            for o in out.outputs:
                text = (out.prompt or eng.engine.tokenizer.decode(out.prompt_token_ids)) + o.text if body.echo else o.text
                choices.append({"index": i * body.n + o.index, "text": text, "finish_reason": o.finish_reason,
                                "stop_reason": o.stop_reason,
                                "logprobs": completion_logprobs(eng, o, 0, len(o.token_ids)) if body.logprobs is not None else None})
        log_request(state, rid, finals, request)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
                "choices": choices, "usage": usage(finals)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        eng = admit(state, body)
        try:
            ids = chat_prompt_ids(eng, body.messages, body.add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = build_params(body, body.max_completion_tokens or body.max_tokens, top)
        streams = start_streams(eng, [ids], params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return sse(chat_chunks(state, body, rid, streams[0]), streams)
        finals = await collect(streams, request)
        choices = [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                    "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
                    "logprobs": chat_logprobs(eng, o, 0, len(o.token_ids), top or 0) if body.logprobs else None}
                   for o in finals[0].outputs]
        log_request(state, rid, finals, request)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
                "choices": choices, "usage": usage(finals)}

    return app


# ---- admission ------------------------------------------------------------------------------------------------
def require_engine(state: ServerState) -> AsyncEngine:
    if state.engine is None:
        raise APIError(503, "the model is still loading", code="loading", retry_after=5)
    if state.engine.dead is not None:
        raise APIError(503, "the engine has stopped", code="engine_dead")
    return state.engine


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


def admit(state: ServerState, body: SamplingFields) -> AsyncEngine:
    eng = require_engine(state)
    check_model(state, body.model)
    if state.draining:
        raise APIError(503, "the server is draining (shutting down); retry on another replica", code="draining",
                       retry_after=1)
    if eng.num_waiting() >= state.config.max_waiting_requests:
        raise APIError(429, f"the queue is full ({state.config.max_waiting_requests} waiting requests)",
                       code="queue_full", retry_after=1)
    return eng


def build_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None):
    try:
        return body.sampling_params(max_tokens, logprobs)
    except ValidationError as e:  # a combination the request model alone cannot judge (e.g. min_tokens > max_tokens)
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise APIError(400, f"{param + ': ' if param else ''}{err['msg']}", param=param, code="invalid_request") from e


def start_streams(eng: AsyncEngine, prompts: list, params) -> list[RequestStream]:
    streams: list[RequestStream] = []
    try:
        for p in prompts:
            streams.append(eng.add_request(p, params))
    except RequestRejected as e:
        for s in streams:
            s.engine.abort(s.request_id)
        raise APIError(400, str(e), param=e.param, code="invalid_request") from e
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_dead") from e
    return streams


def chat_prompt_ids(eng: AsyncEngine, messages, add_generation_prompt: bool) -> list[int]:
    convo = [{"role": m.role, "content": m.text()} for m in messages]
    ids = eng.engine.tokenizer.apply_chat_template(convo, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def collect(streams: list[RequestStream], request: Request) -> list[RequestOutput]:
    """Wait for every stream to finish; a client that hangs up aborts them (and frees their blocks)."""
    task = asyncio.ensure_future(asyncio.gather(*(s.final() for s in streams)))
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            for s in streams:
                s.engine.abort(s.request_id)
            raise APIError(499, "client disconnected")


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        async for out in s:
            await q.put((i, out))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out = await q.get()
            if out.finished:
                remaining -= 1
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


def sse(chunks: AsyncIterator[dict], streams: list[RequestStream]) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except EngineDeadError as e:
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error', 'param': None, 'code': '503'}})}\n\n"
        finally:
            for s in streams:  # no-op for finished ones; aborts the rest when the client is gone
                s.engine.abort(s.request_id)
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class DeltaTracker:
    """What of each choice has been sent so far, so each chunk carries only the new part."""

    def __init__(self):
        self.sent_text: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.finished: set[int] = set()

    def delta(self, key: int, o: CompletionOutput) -> tuple[str, int, int, str | None] | None:
        t0, k0 = self.sent_text.get(key, 0), self.sent_tokens.get(key, 0)
        text, k1 = o.text[t0:], len(o.token_ids)
        finish = o.finish_reason if o.finish_reason and key not in self.finished else None
        if not text and finish is None and k1 == k0:
            return None
        self.sent_text[key], self.sent_tokens[key] = len(o.text), k1
        if finish:
            self.finished.add(key)
        return text, k0, k1, finish


async def completion_chunks(state, body: CompletionRequest, rid: str, streams) -> AsyncIterator[dict]:
    eng, created, tracker, finals, echoed = state.engine, int(time.time()), DeltaTracker(), {}, set()
    async for i, out in merged(streams):
        for o in out.outputs:
            d = tracker.delta(i * body.n + o.index, o)
            if d is None:
                continue
            text, k0, k1, finish = d
            if body.echo and (i, o.index) not in echoed:  # the prompt goes first, once per choice
                echoed.add((i, o.index))
                text = (out.prompt or eng.engine.tokenizer.decode(out.prompt_token_ids)) + text
            yield {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                   "choices": [{"index": i * body.n + o.index, "text": text, "finish_reason": finish,
                                "stop_reason": o.stop_reason if finish else None,
                                "logprobs": completion_logprobs(eng, o, k0, k1) if body.logprobs is not None else None}]}
        if out.finished:
            finals[i] = out
    if body.stream_options and body.stream_options.include_usage:
        yield {"id": rid, "object": "text_completion", "created": created, "model": state.model_name, "choices": [],
               "usage": usage(list(finals.values()))}


async def chat_chunks(state, body: ChatCompletionRequest, rid: str, stream: RequestStream) -> AsyncIterator[dict]:
    eng, created, tracker, final = state.engine, int(time.time()), DeltaTracker(), None

    def chunk(choices):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                "choices": choices}

    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for i in range(body.n)])
    async for out in stream:
        for o in out.outputs:
            d = tracker.delta(o.index, o)
            if d is None:
                continue
            text, k0, k1, finish = d
            yield chunk([{"index": o.index, "delta": {"content": text} if text else {},
                          "logprobs": chat_logprobs(eng, o, k0, k1, body.top_logprobs or 0) if body.logprobs else None,
                          "finish_reason": finish, "stop_reason": o.stop_reason if finish else None}])
        if out.finished:
            final = out
    if body.stream_options and body.stream_options.include_usage:
        c = chunk([])
        c["usage"] = usage([final] if final else [])
        yield c


# ---- response pieces ---------------------------------------------------------------------------------------------
def usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(len(o.token_ids) for f in finals for o in f.outputs)
    cached = sum(f.num_cached_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token_str(eng: AsyncEngine, tok: int) -> str:
    return eng.engine.tokenizer.decode([tok])


def completion_logprobs(eng: AsyncEngine, o: CompletionOutput, k0: int, k1: int) -> dict:
    tokens, lps, tops = [], [], []
    for tok, lp in zip(o.token_ids[k0:k1], (o.logprobs or [])[k0:k1], strict=False):
        tokens.append(_token_str(eng, tok))
        lps.append(lp[tok])
        tops.append({_token_str(eng, t): v for t, v in lp.items()})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": []}


def chat_logprobs(eng: AsyncEngine, o: CompletionOutput, k0: int, k1: int, top_k: int) -> dict:
    content = []
    for tok, lp in zip(o.token_ids[k0:k1], (o.logprobs or [])[k0:k1], strict=False):
        s = _token_str(eng, tok)
        top = sorted(lp.items(), key=lambda x: -x[1])[:top_k]
        content.append({"token": s, "logprob": lp[tok], "bytes": list(s.encode()),
                        "top_logprobs": [{"token": (ts := _token_str(eng, t)), "logprob": v, "bytes": list(ts.encode())}
                                         for t, v in top]})
    return {"content": content}


def log_request(state: ServerState, rid: str, finals: list[RequestOutput], request: Request) -> None:
    if state.config.disable_log_requests:
        return
    now = time.monotonic()
    m = finals[0].metrics
    record = {"event": "request", "id": rid, "path": request.url.path, "model": state.model_name,
              "prompt_tokens": sum(len(f.prompt_token_ids) for f in finals),
              "completion_tokens": sum(len(o.token_ids) for f in finals for o in f.outputs),
              "finish_reason": [o.finish_reason for f in finals for o in f.outputs],
              "latency_s": round(now - m.arrival_time, 4) if m else None,
              "ttft_s": round(m.first_token_time - m.arrival_time, 4) if m and m.first_token_time else None}
    if state.config.log_prompts:
        record["prompt"] = [f.prompt for f in finals]
    request_log.info(record)
