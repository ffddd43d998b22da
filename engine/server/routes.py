"""The HTTP routes (an APIRouter): health and metrics, the OpenAI API, tokenize/detokenize, and drain-aware
admission. Responses are rendered by engine/server/rendering.py."""

from __future__ import annotations

import asyncio
import functools
import os
import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

import pagekube
from pagekube.engine.async_engine import AsyncEngine, RequestStream
from pagekube.engine.chat import chat_prompt_ids
from pagekube.engine.errors import AdapterError, EngineDeadError, RequestRejected
from pagekube.engine.lora.request import LoRARequest
from pagekube.engine.sampling_params import RequestOutputKind
from pagekube.engine.server.errors import APIError, error_response
from pagekube.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    SamplingFields,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pagekube.engine.server.rendering import (
    Usage,
    chat_chunks,
    chat_logprobs,
    collect,
    completion_chunks,
    completion_logprobs,
    prompt_text,
    served_name,
    sse,
)
from pagekube.engine.server.state import ServerState
from pagekube.engine.tool_calls import ToolReply, forced_schema

router = APIRouter()


def server_state(request: Request) -> ServerState:
    return request.app.state.pk


# ---- open endpoints ---------------------------------------------------------------------------------------
@router.get("/health")
async def health(state: ServerState = Depends(server_state)):
    if state.healthy:
        return Response(status_code=200)
    reason = "draining" if state.draining else ("loading" if state.engine is None else "engine dead")
    return error_response(503, f"not ready: {reason}", code=reason.replace(" ", "_"))


@router.get("/ping")
async def ping(state: ServerState = Depends(server_state)):
    return await health(state)


@router.get("/version")
async def version(state: ServerState = Depends(server_state)):
    """The version, and (once loaded) which kernels run: device, dtype, attention backend, CPU extension kernels."""
    return {"version": pagekube.__version__, **({"kernels": state.kernels} if state.kernels else {})}


@router.get("/metrics")
async def metrics(state: ServerState = Depends(server_state)):
    if state.metrics is None:
        return Response(b"", media_type=CONTENT_TYPE_LATEST)
    state.metrics.draining.set(1 if state.draining else 0)
    if state.engine is not None:  # admitted requests count from admission, tokenizing ones included
        state.metrics.waiting.set(state.engine.num_waiting())
        lora = getattr(getattr(state.engine, "engine", None), "lora", None)
        if state.metrics.lora is not None and lora is not None:
            state.metrics.lora.refresh_loaded(lora)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

# ---- OpenAI API -------------------------------------------------------------------------------------------
@router.get("/v1/models")
async def models(state: ServerState = Depends(server_state)):
    """The base model, then each LoRA adapter with `parent` = the base model, as vLLM lists them."""
    eng = require_engine(state)
    card = {"object": "model", "created": state.created, "owned_by": "pagekube", "parent": None,
            "max_model_len": eng.engine.max_model_len}
    data = [{**card, "id": state.model_name, "root": str(eng.engine.model_dir)}]
    lora = getattr(eng.engine, "lora", None)
    for adapter in lora.names() if lora is not None else ():
        data.append({**card, "id": adapter.lora_name, "root": adapter.lora_path, "parent": state.model_name})
    return {"object": "list", "data": data}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: ServerState = Depends(server_state)):
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


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: ServerState = Depends(server_state)):
    eng = require_engine(state)
    check_model(state, body.model)
    vocab = len(eng.engine.tokenizer)
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": await eng.run_tokenizer(eng.engine.tokenizer.decode, body.tokens)}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: ServerState = Depends(server_state)):
    eng, lora = admit(state, body)
    rid = f"cmpl-{uuid.uuid4().hex}"
    try:
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        params = build_params(body, max_tokens, body.logprobs)
        prompts = body.prompts()  # at least one: [] is one empty prompt, which the engine refuses
    except BaseException:
        eng.release()
        raise
    streams = await start_streams(eng, prompts, params, rid, body, lora)  # takes the admission slot over
    if body.stream:
        return sse(completion_chunks(state, body, rid, streams), streams)
    finals = await collect(streams, request)
    choices = []
    for i, out in enumerate(finals):
        prompt = prompt_text(eng, out) if body.echo else ""
        for o in out.outputs:
            choices.append({"index": i * body.n + o.index, "text": prompt + o.text, "finish_reason": o.finish_reason,
                            "stop_reason": o.stop_reason,
                            "logprobs": await completion_logprobs(eng, o.token_ids, o.logprobs) if body.logprobs is not None else None})
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": served_name(state, body),
            "choices": choices, "usage": Usage.of(finals).as_dict()}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: ServerState = Depends(server_state)):
    eng, lora = admit(state, body)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        ids, params, reply = await chat_request(state, eng, body)
    except BaseException:
        eng.release()
        raise
    streams = await start_streams(eng, [ids], params, rid, body, lora)  # takes the admission slot over
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
                        "logprobs": await chat_logprobs(eng, o.token_ids, o.logprobs, top or 0) if body.logprobs else None})
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": served_name(state, body),
            "choices": choices, "usage": Usage.of(finals).as_dict()}


# ---- LoRA adapters at run time (vLLM's endpoints, behind its VLLM_ALLOW_RUNTIME_LORA_UPDATING switch) ----------
def runtime_lora(state: ServerState):
    if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() not in ("1", "true"):
        raise APIError(404, "runtime LoRA updating is off: start the server with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",
                       code="not_found")
    lora = getattr(require_engine(state).engine, "lora", None)
    if lora is None:
        raise APIError(400, "LoRA is not enabled: start the server with --enable-lora", code="invalid_request")
    return lora


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: ServerState = Depends(server_state)):
    """Read and check the adapter off the event loop, then serve it under its name (400 if it cannot serve)."""
    lora = runtime_lora(state)
    try:
        await asyncio.to_thread(lora.add, lora.new_request(body.lora_name, body.lora_path))
    except AdapterError as e:
        raise APIError(400, str(e), param="lora_path", code="invalid_request") from e
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: ServerState = Depends(server_state)):
    """New requests stop finding the adapter at once; requests already using it finish with it."""
    if runtime_lora(state).remove(body.lora_name) is None:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                       code="not_found")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


# ---- admission ------------------------------------------------------------------------------------------------
def require_engine(state: ServerState) -> AsyncEngine:
    if state.engine is None:
        raise APIError(503, "the model is still loading", code="loading", retry_after=5)
    if state.engine.dead is not None:
        raise APIError(503, "the engine has stopped", code="engine_dead")
    return state.engine


def check_model(state: ServerState, model: str | None) -> LoRARequest | None:
    """The request's `model`: the base model (None), one of its LoRA adapters, or a 404."""
    if model is None or model == state.model_name:
        return None
    lora = getattr(state.engine.engine, "lora", None) if state.engine is not None else None
    adapter = lora.resolve(model) if lora is not None else None
    if adapter is None:
        served = [state.model_name, *(a.lora_name for a in lora.names())] if lora is not None else [state.model_name]
        raise APIError(404, f"The model `{model}` does not exist; this server serves {', '.join(map(repr, served))}",
                       param="model", code="model_not_found")
    return adapter


def admit(state: ServerState, body: SamplingFields) -> tuple[AsyncEngine, LoRARequest | None]:
    eng = require_engine(state)
    lora = check_model(state, body.model)
    if eng.engine.runner_type == "pooling":
        raise APIError(400, f"the model {state.model_name!r} is an embedding model (the pooling runner): it serves "
                            "/v1/embeddings, not completions", param="model", code="unsupported_model")
    return enter_queue(state, eng), lora


def enter_queue(state: ServerState, eng):
    """Drain and queue-length admission, for generation and embeddings alike; the request counts as waiting from
    here (`reserve`): its first engine request takes that slot over (generation), or its handler releases it once
    its work is queued (embeddings)."""
    if state.draining:
        raise APIError(503, "the server is draining (shutting down); retry on another replica", code="draining",
                       retry_after=1)
    if eng.num_waiting() >= state.config.max_waiting_requests:
        raise APIError(429, f"the queue is full ({state.config.max_waiting_requests} waiting requests)",
                       code="queue_full", retry_after=1)
    eng.reserve()
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


async def start_streams(eng: AsyncEngine, prompts: list, params, rid: str, body: SamplingFields,
                        lora: LoRARequest | None = None) -> list[RequestStream]:
    """One engine request per prompt, with ids derived from the API request's (`rid`, or `rid-i` for several),
    so the engine's per-request log lines name what the client saw. The API request's admission slot (enter_queue)
    becomes its first engine request's: a request waiting to be queued is counted once, never twice."""
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(prompts):
            streams.append(await eng.add_request(p, params, rid if len(prompts) == 1 else f"{rid}-{i}", reserved=i == 0,
                                                 lora_request=lora))
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
