"""ASGI middleware: request body size limit (413, declared or chunked) and API-key auth (401), before any route
runs."""

from __future__ import annotations

import json

from pagekube.engine.server.api_keys import APIKeys
from pagekube.engine.server.errors import error_body

OPEN_PATHS = {"/health", "/ping", "/metrics", "/version"}


async def _send_error(send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    def __init__(self, app, keys: APIKeys, max_body_bytes: int):
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.keys.enabled and scope["path"] not in OPEN_PATHS:
            auth = headers.get(b"authorization", b"")
            token = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not self.keys.accepts(token):
                return await _send_error(send, 401, "missing or invalid API key", "invalid_api_key")
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > self.max_body_bytes:
            return await _send_error(send, 413, f"request body exceeds {self.max_body_bytes} bytes", "body_too_large")
        if b"content-length" not in headers and b"transfer-encoding" in headers:
            # Chunked: read it whole here (bounded by the limit), so an oversized one is a 413, not a parse error.
            body, more = bytearray(), True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > self.max_body_bytes:
                    return await _send_error(send, 413, f"request body exceeds {self.max_body_bytes} bytes",
                                             "body_too_large")
            replayed = False

            async def receive_buffered():
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}

            return await self.app(scope, receive_buffered, send)
        return await self.app(scope, receive, send)
