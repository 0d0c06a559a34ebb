"""Anthropic's Messages API over the same serving as OpenAI's: `POST /v1/messages` (plain, or streamed as
Anthropic's named events) and `POST /v1/messages/count_tokens`, for the anthropic SDKs and the agents built
on them.

A request is translated into a chat completion (api/anthropic_protocol.py) and runs through the one chat
pipeline (templates, grammars, tools, prefix reuse, metrics, cancellation when the client leaves);
api/anthropic_formats.py writes the answer in Anthropic's shapes. Errors come back in Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`) naming the field; the API key may come as `x-api-key`
(api/access.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from corolla.api import chat
from corolla.api.anthropic_formats import AnthropicFormat, error_body
from corolla.api.anthropic_protocol import CountTokensRequest, MessagesRequest
from corolla.api.chat_protocol import ChatCompletionRequest
from corolla.api.http import parse, problems, respond, until_disconnected
from corolla.api.protocol import ErrorResponse
from corolla.errors import InvalidRequest

if TYPE_CHECKING:
    from corolla.api.serving import OpenAIServing


class AnthropicServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def messages(self, body: MessagesRequest) -> Any:
        try:
            request = body.to_openai()
        except (InvalidRequest, ValidationError) as e:
            return _error(400, problems(e))
        return await self.serving.create_chat_completion(request, AnthropicFormat)

    async def count_tokens(self, body: CountTokensRequest) -> Any:
        try:
            request = ChatCompletionRequest.model_validate(body.chat_fields())
        except (InvalidRequest, ValidationError) as e:
            return _error(400, problems(e))
        prompt = chat.prepare(self.serving.model.tokenizer, request)
        return prompt if isinstance(prompt, ErrorResponse) else {"input_tokens": len(prompt.ids)}

    def answer(self, endpoint: str, result: Any) -> Response:
        """The HTTP response for a result: Anthropic's message, its event stream, or its error shape."""
        return respond(
            self.serving.metrics,
            f"anthropic_{endpoint}",
            result,
            lambda error: error_body(error.status, error.error.message),
        )


def install_routes(app: FastAPI, serving: OpenAIServing) -> None:
    anthropic = AnthropicServing(serving)

    async def run(request: Request, endpoint: str, model: type[BaseModel], handler: Any) -> Response:
        body = await parse(request, model)
        if not isinstance(body, ErrorResponse) and body.model != serving.name:
            body = _error(404, f"model: {body.model!r} does not exist; this server serves {serving.name!r}")
        if isinstance(body, ErrorResponse):
            return anthropic.answer(endpoint, body)
        return anthropic.answer(endpoint, await until_disconnected(request, handler(body)))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await run(request, "messages", MessagesRequest, anthropic.messages)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await run(request, "count_tokens", CountTokensRequest, anthropic.count_tokens)


def _error(status: int, message: str) -> ErrorResponse:
    return ErrorResponse.make(status, message, "invalid_request_error")
