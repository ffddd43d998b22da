"""POST /v1/embeddings (OpenAI's shape) on a pooling model: tokenizing, the response's floats or base64
(little-endian float32, which the official client asks for by default) and its JSON are made on the tokenizer
thread, never on the event loop."""

from __future__ import annotations

import base64
import json
import time
import uuid

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from pagekube.engine.errors import EngineDeadError, RequestRejected
from pagekube.engine.server.errors import APIError
from pagekube.engine.server.protocol import EmbeddingRequest
from pagekube.engine.server.routes import check_model, enter_queue, require_engine, server_state
from pagekube.engine.server.state import ServerState

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, state: ServerState = Depends(server_state)):
    eng = require_engine(state)
    check_model(state, body.model)
    if eng.engine.runner_type != "pooling":
        raise APIError(400, f"the model {state.model_name!r} generates text and makes no embeddings; serve an "
                            "embedding model (or this one with --runner pooling) for /v1/embeddings",
                       param="model", code="unsupported_model")
    enter_queue(state, eng)  # counted as waiting while it tokenizes; its inputs count once queued (no await between)
    try:
        eng.engine.check_dimensions(body.dimensions)
        prompts = await eng.run_tokenizer(eng.engine.prepare_inputs, body.input, body.truncate_prompt_tokens,
                                          body.add_special_tokens)
    except RequestRejected as e:
        raise APIError(400, str(e), param=e.param, code="invalid_request") from e
    finally:
        eng.release()
    try:
        job = await eng.embed(prompts, f"embd-{uuid.uuid4().hex}")
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_dead") from e
    content = await eng.run_tokenizer(render, eng.engine, job, body, state.model_name)
    return Response(content, media_type="application/json")


def render(engine, job, body: EmbeddingRequest, model_name: str) -> bytes:
    data = []
    for i, pooled in enumerate(job.results):
        vector = engine.finish(pooled, body.dimensions).numpy()
        embedding = (base64.b64encode(vector.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
                     else vector.tolist())
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    tokens = sum(len(p) for p in job.prompts)
    return json.dumps({"id": job.request_id, "object": "list", "created": int(time.time()), "model": model_name,
                       "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}).encode()

