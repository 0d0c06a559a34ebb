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

from corolla.api import chat
from corolla.api.anthropic_formats import AnthropicFormat, error_body
from corolla.api.anthropic_protocol import CountTokensRequest, MessagesRequest
from corolla.api.chat_protocol import ChatCompletionRequest
from corolla.api.dialects import Dialect, translated
from corolla.api.protocol import ErrorResponse

if TYPE_CHECKING:
    from corolla.api.serving import OpenAIServing


class AnthropicServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.dialect = Dialect(serving, "anthropic", lambda e: error_body(e.status, e.error.message))

    async def messages(self, body: MessagesRequest) -> Any:
        request = translated(body.to_openai)
        if isinstance(request, ErrorResponse):
            return request
        return await self.serving.create_chat_completion(request, AnthropicFormat)

    async def count_tokens(self, body: CountTokensRequest) -> Any:
        request = translated(lambda: ChatCompletionRequest.model_validate(body.chat_fields()))
        if isinstance(request, ErrorResponse):
            return request
        prompt = chat.prepare(self.serving.model.tokenizer, request)
        return prompt if isinstance(prompt, ErrorResponse) else {"input_tokens": len(prompt.ids)}


def install_routes(app: FastAPI, serving: OpenAIServing) -> None:
    anthropic = AnthropicServing(serving)
    run = anthropic.dialect.run

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await run(request, "messages", MessagesRequest, anthropic.messages)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await run(request, "count_tokens", CountTokensRequest, anthropic.count_tokens)
