"""Who may call the API, from which web origins, and an id on every answer.

- API keys (`--api-key`, repeatable, or COROLLA_API_KEY): every /v1 route, /tokenize and /detokenize
  (vLLM keeps them outside /v1, but they use the model) need `Authorization: Bearer KEY` with one of
  them; a missing or wrong key gets a 401 in OpenAI's error shape. /health, /metrics, /version and the
  dashboard stay open (probes and scrapers carry no keys). Keys are compared in constant time.
- CORS (`--allowed-origins`, repeatable; `*` for any): Starlette's CORSMiddleware, so browser apps on
  those origins can call the API. Without the flag, no CORS headers (browsers refuse cross-origin calls).
- Request ids: every answer carries `X-Request-Id`, the caller's own if it sent one (at most 128
  printable characters), else a new one, for matching a client's error with the server's log.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corolla.api.protocol import ErrorResponse

REQUEST_ID = "X-Request-Id"
MAX_REQUEST_ID = 128
PROTECTED_PREFIXES = ("/v1/", "/api/")  # OpenAI's routes and Ollama's
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize"})


def install(app: FastAPI, api_keys: Sequence[str] = (), allowed_origins: Sequence[str] = ()) -> None:
    """Add the key check, CORS and request ids to `app` (CORS outermost: preflights need no key)."""
    app.add_middleware(Access, keys=[key.encode() for key in api_keys])
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version", REQUEST_ID],
            expose_headers=[REQUEST_ID],
        )


class Access:
    """Plain ASGI (not BaseHTTPMiddleware, which wraps `receive`: the routes watch it for disconnects)."""

    def __init__(self, app: ASGIApp, keys: list[bytes]):
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        request_id = _request_id(request.headers.get(REQUEST_ID))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID] = request_id
            await send(message)

        refusal = _refusal(request, self.keys)
        await (refusal or self.app)(scope, receive, send_with_id)


def _refusal(request: Request, keys: list[bytes]) -> Response | None:
    """A 401 unless the route is open, no keys are set, or the request carries one of them."""
    path = request.url.path
    is_protected = path.startswith(PROTECTED_PREFIXES) or path.rstrip("/") in PROTECTED_PATHS
    if not keys or not is_protected or request.method == "OPTIONS":
        return None
    given = presented_key(request)
    if any(secrets.compare_digest(given.encode(), k) for k in keys):
        return None
    what = "a wrong API key" if given else "no API key"
    error = ErrorResponse.make(
        401,
        f"the request carries {what}: send `Authorization: Bearer KEY` (or `x-api-key: KEY`) with a key this "
        "server was given (--api-key)",
        "invalid_request_error",
        code="invalid_api_key",
    )
    return JSONResponse(error.model_dump(), status_code=401, headers={"WWW-Authenticate": "Bearer"})


def presented_key(request: Request) -> str:
    """The API key a request carries ("" if none): a bearer token, or `x-api-key` as Anthropic's SDKs send
    it. Past the key check, it is one of the server's keys (or the server takes any)."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        given = request.headers.get("x-api-key", "")
    return given.strip()


def _request_id(given: str | None) -> str:
    if given and len(given) <= MAX_REQUEST_ID and given.isprintable():
        return given
    return uuid.uuid4().hex
