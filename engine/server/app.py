"""FastAPI app: OpenAI-compatible endpoints over the AsyncEngine, health, metrics and drain-aware admission."""

from __future__ import annotations

import asyncio
import functools
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
from pagekube.engine.async_engine import AsyncEngine, RequestStream
from pagekube.engine.chat import chat_prompt_ids
from pagekube.engine.config import EngineConfig
from pagekube.engine.errors import EngineDeadError, RequestRejected
from pagekube.engine.outputs import RequestOutput
from pagekube.engine.sampling_params import RequestOutputKind
from pagekube.engine.server.errors import APIError, error_body, error_response
from pagekube.engine.server.metrics import EngineMetrics
from pagekube.engine.server.middleware import GuardMiddleware
from pagekube.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from pagekube.engine.tool_calls import ToolReply, forced_schema

log = logging.getLogger("pagekube.server")


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
        log.exception("unhandled error")
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
        if state.engine is not None:  # admitted requests count from admission, tokenizing ones included
            state.metrics.waiting.set(state.engine.num_waiting())
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
            try:
                ids = await eng.run_tokenizer(chat_prompt_ids, tok, conversation(body.messages), True)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from e
        elif body.prompt is not None:
            ids = await eng.run_tokenizer(functools.partial(tok.encode, add_special_tokens=body.add_special_tokens),
                                          body.prompt)
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
        return {"prompt": await eng.run_tokenizer(eng.engine.tokenizer.decode, body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        eng = admit(state, body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        try:
            max_tokens = body.max_tokens if body.max_tokens is not None else 16
            params = build_params(body, max_tokens, body.logprobs)
            streams = await start_streams(eng, body.prompts(), params, rid, body)
        finally:
            eng.release()  # its requests count as waiting on their own now (or it failed)
        if body.stream:
            return sse(completion_chunks(state, body, rid, streams), streams)
        finals = await collect(streams, request)
        choices = []
        for i, out in enumerate(finals):
            prompt = prompt_text(eng, out) if body.echo else ""
            for o in out.outputs:
                choices.append({"index": i * body.n + o.index, "text": prompt + o.text, "finish_reason": o.finish_reason,
                                "stop_reason": o.stop_reason,
                                "logprobs": completion_logprobs(eng, o.token_ids, o.logprobs) if body.logprobs is not None else None})
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
                "choices": choices, "usage": Usage.of(finals).as_dict()}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        eng = admit(state, body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            ids, params, reply = await chat_request(state, eng, body)
            streams = await start_streams(eng, [ids], params, rid, body)
        finally:
            eng.release()  # its request counts as waiting on its own now (or it failed)
        top = (body.top_logprobs or 0) if body.logprobs else None
        if body.stream:
            return sse(chat_chunks(state, body, rid, streams[0], reply), streams)
        finals = await collect(streams, request)
        choices = []
        for o in finals[0].outputs:
            message, finish = {"role": "assistant", "content": o.text}, o.finish_reason
            if reply is not None:
                message, finish = reply.fresh().message(o.text, o.finish_reason)
            choices.append({"index": o.index, "message": message, "finish_reason": finish, "stop_reason": o.stop_reason,
                            "logprobs": chat_logprobs(eng, o.token_ids, o.logprobs, top or 0) if body.logprobs else None})
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
                "choices": choices, "usage": Usage.of(finals).as_dict()}

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
    eng.reserve()  # counted as waiting from here: the handler releases it once its requests are added
    return eng


async def chat_request(state: ServerState, eng: AsyncEngine, body: ChatCompletionRequest):
    """The prompt ids (chat template applied, on the tokenizer thread), sampling params and tool-call handling."""
    choice = body.effective_tool_choice()
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools and choice != "none" else None
    try:
        ids = await eng.run_tokenizer(chat_prompt_ids, eng.engine.tokenizer, conversation(body.messages),
                                      body.add_generation_prompt, tools)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from e
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = build_params(body, body.max_completion_tokens or body.max_tokens, top)
    reply = tool_reply(state, body, choice)
    if reply is not None and (forced := forced_schema(tools, choice)) is not None:
        if body.structured_fields():
            raise APIError(400, f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} "
                                f"already constrains the output; drop {body.structured_fields()[0]}",
                           param="tool_choice", code="invalid_request")
        params = params.model_copy(update={"structured_outputs": forced})
    return ids, params, reply


def build_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None):
    # Streams get only what is new at each step; a plain response only the final output.
    kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
    try:
        return body.sampling_params(max_tokens, logprobs, kind)
    except ValidationError as e:  # a combination the request model alone cannot judge (e.g. min_tokens > max_tokens)
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise APIError(400, f"{param + ': ' if param else ''}{err['msg']}", param=param, code="invalid_request") from e


async def start_streams(eng: AsyncEngine, prompts: list, params, rid: str, body: SamplingFields) -> list[RequestStream]:
    """One engine request per prompt, with ids derived from the API request's (`rid`, or `rid-i` for several),
    so the engine's per-request log lines name what the client saw."""
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(prompts):
            streams.append(await eng.add_request(p, params, rid if len(prompts) == 1 else f"{rid}-{i}"))
    except RequestRejected as e:
        for s in streams:
            s.engine.abort(s.request_id)
        param = e.param
        if param and param.startswith("structured_outputs") and body.structured_fields():
            param = body.structured_fields()[0]  # the field the client sent: response_format, guided_json...
        raise APIError(400, str(e), param=param, code="invalid_request") from e
    except EngineDeadError as e:
        for s in streams:
            s.engine.abort(s.request_id)
        raise APIError(503, str(e), code="engine_dead") from e
    return streams


def conversation(messages) -> list[dict]:
    return [m.as_template_input() for m in messages]


def tool_reply(state: ServerState, body: ChatCompletionRequest, choice) -> ToolReply | None:
    """How this request's replies become tool calls; None when no tools are in play."""
    if choice == "none":
        return None
    if isinstance(choice, dict):
        return ToolReply("named", function=choice["function"]["name"])
    if choice == "required":
        return ToolReply("required")
    if not (state.config.enable_auto_tool_choice and state.config.tool_call_parser):
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                            '(or send tool_choice "required", "none" or a named function)', param="tool_choice",
                       code="invalid_request")
    return ToolReply("auto", parser=state.config.tool_call_parser)


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
            yield {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                   "choices": [{"index": i * body.n + o.index, "text": text, "finish_reason": o.finish_reason,
                                "stop_reason": o.stop_reason,
                                "logprobs": completion_logprobs(eng, o.token_ids, o.logprobs) if body.logprobs is not None else None}]}
        if out.finished:
            counts.add_request(out)
    if body.stream_options and body.stream_options.include_usage:
        yield {"id": rid, "object": "text_completion", "created": created, "model": state.model_name, "choices": [],
               "usage": counts.as_dict()}


async def chat_chunks(state, body: ChatCompletionRequest, rid: str, stream: RequestStream,
                      reply: ToolReply | None = None) -> AsyncIterator[dict]:
    eng, created, counts = state.engine, int(time.time()), Usage()
    replies = {i: reply.fresh() for i in range(body.n)} if reply is not None else None

    def chunk(choices):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                "choices": choices}

    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for i in range(body.n)])
    async for out in stream:
        for o in out.outputs:
            counts.completion += len(o.token_ids)
            logprobs = chat_logprobs(eng, o.token_ids, o.logprobs, body.top_logprobs or 0) if body.logprobs else None
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


def _token_str(eng: AsyncEngine, tok: int) -> str:
    return eng.engine.tokenizer.decode([tok])


def completion_logprobs(eng: AsyncEngine, token_ids: list[int], logprobs: list[dict] | None) -> dict:
    tokens, lps, tops = [], [], []
    for tok, lp in zip(token_ids, logprobs or [], strict=False):
        tokens.append(_token_str(eng, tok))
        lps.append(lp[tok])
        tops.append({_token_str(eng, t): v for t, v in lp.items()})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": []}


def chat_logprobs(eng: AsyncEngine, token_ids: list[int], logprobs: list[dict] | None, top_k: int) -> dict:
    content = []
    for tok, lp in zip(token_ids, logprobs or [], strict=False):
        s = _token_str(eng, tok)
        top = sorted(lp.items(), key=lambda x: -x[1])[:top_k]
        content.append({"token": s, "logprob": lp[tok], "bytes": list(s.encode()),
                        "top_logprobs": [{"token": (ts := _token_str(eng, t)), "logprob": v, "bytes": list(ts.encode())}
                                         for t, v in top]})
    return {"content": content}
