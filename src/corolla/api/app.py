"""HTTP routes: parse and validate the request, call serving, map its result to an HTTP response.

Bodies are parsed with api/http.py's `parse`, so every bad request gets OpenAI's error shape with the
offending field named. Generating routes race the client's disconnect: a client that goes away cancels
its request, which aborts the generation and closes its sessions on the servers (see tracker.py). A
stream's end, however it comes, does the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib.resources import files
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from corolla.api import access, anthropic, embeddings, ollama, responses, utility
from corolla.api.chat_protocol import ChatCompletionRequest
from corolla.api.http import EventStreamResponse, parse, until_disconnected
from corolla.api.protocol import CompletionRequest, ErrorResponse
from corolla.api.serving import OpenAIServing
from corolla.api.streams import EventStream
from corolla.client.training.embeddings import Pooling
from corolla.config import ApiConfig

logger = logging.getLogger(__name__)


def build_app(serving: OpenAIServing, config: ApiConfig | None = None) -> FastAPI:  # noqa: C901 (routes)
    """The app; with `config.api_keys`, /v1 routes, /tokenize and /detokenize need one; `allowed_origins`
    for CORS (api/access.py); `embedding_pooling` for /v1/embeddings (client/training/embeddings.py);
    every `stats_interval` seconds with traffic (0: never), a log line of running requests and throughput."""
    config = config or ApiConfig()
    stats_interval = config.stats_interval

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        report = serving.log.report_every(stats_interval) if stats_interval > 0 else None
        stats = asyncio.ensure_future(report) if report is not None else None
        yield
        if stats is not None:
            stats.cancel()
        serving.tracker.abort_all()  # the server stops: no generation outlives it

    app = FastAPI(title="corolla", summary="OpenAI-compatible API over a corolla swarm", lifespan=lifespan)
    access.install(app, config.api_keys, config.allowed_origins)
    metrics = serving.metrics

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        """Unknown routes and methods get OpenAI's error shape too, not FastAPI's {"detail": ...}."""
        known = {404: "no such route", 405: "method not allowed on this route"}
        message = f"{known.get(e.status_code, e.detail)}: {request.method} {request.url.path}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        error = ErrorResponse.make(e.status_code, message, "invalid_request_error", code=code)
        return JSONResponse(
            error.model_dump(), status_code=e.status_code, headers=getattr(e, "headers", None)
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        """A bug answers in OpenAI's error shape too, not in plain text (Starlette still logs it)."""
        metrics.errors.labels("server_error").inc()
        error = ErrorResponse.make(500, f"internal error: {type(e).__name__}", "server_error")
        return JSONResponse(error.model_dump(), status_code=500)

    def answer(endpoint: str, result: Any) -> Response:
        if isinstance(result, ErrorResponse):
            response: Response = JSONResponse(result.model_dump(), status_code=result.status)
            metrics.errors.labels(result.error.type).inc()
        elif isinstance(result, EventStream):
            response = EventStreamResponse(result)
        else:
            response = JSONResponse(result.model_dump(exclude_none=False))
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    async def generate(
        request: Request, endpoint: str, model: type[BaseModel], handler: Callable[[Any], Awaitable[Any]]
    ) -> Response:
        parsed = await parse(request, model)
        if isinstance(parsed, ErrorResponse):
            return answer(endpoint, parsed)
        if parsed.model is not None and parsed.model != serving.name:  # None: left out where optional
            return answer(endpoint, utility.model_not_found(parsed.model, serving.name))
        return answer(endpoint, await until_disconnected(request, handler(parsed)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completions", CompletionRequest, serving.create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat", ChatCompletionRequest, serving.create_chat_completion)

    @app.get("/v1/models")
    async def models() -> Response:
        return answer("models", serving.models())

    embeddings.install_routes(app, generate, serving, cast(Pooling, config.embedding_pooling))
    ollama.install_routes(app, serving)
    anthropic.install_routes(app, serving)
    responses.install_routes(app, serving, config.stored_responses)
    utility.install_routes(app, generate, answer, serving)

    @app.get("/v1/swarm")
    async def swarm() -> Response:
        return JSONResponse(await serving.overview())

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse(
            {"status": "ok", "model": serving.name, "active_requests": serving.tracker.num_active}
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(files("corolla.api").joinpath("dashboard.html").read_text())

    @app.get("/chat", response_class=HTMLResponse)
    async def chat_page() -> HTMLResponse:
        """A chat with the model, each token marked with the servers that computed it (chat.html)."""
        return HTMLResponse(files("corolla.api").joinpath("chat.html").read_text())

    return app
