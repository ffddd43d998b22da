"""FastAPI app: the routes (engine/server/routes.py) behind the auth and body-size guard, and the error handlers
that give every failure the OpenAI error shape."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagekube
from pagekube.engine.server.api_keys import APIKeys
from pagekube.engine.server.embeddings import router as embeddings_router
from pagekube.engine.server.errors import APIError, error_response
from pagekube.engine.server.middleware import GuardMiddleware
from pagekube.engine.server.routes import router
from pagekube.engine.server.state import ServerState

log = logging.getLogger("pagekube.server")

__all__ = ["ServerState", "create_app"]


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="pagekube", version=pagekube.__version__)
    app.state.pk = state
    keys = APIKeys(state.config.api_key, state.config.api_key_file)
    app.add_middleware(GuardMiddleware, keys=keys, max_body_bytes=state.config.max_body_bytes)

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

    app.include_router(router)
    app.include_router(embeddings_router)
    return app
