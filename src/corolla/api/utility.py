"""The API's small routes around the model: one model's card, tokenize, detokenize and the version.

`GET /v1/models/{id}` answers the served model's card or OpenAI's 404 (ids may hold slashes). `POST
/tokenize` and `POST /detokenize` take vLLM's shapes, outside /v1 as vLLM has them; a chat is rendered
by `chat.render` as chat completions render theirs (same messages, tools, template and errors). `GET
/version` gives corolla's version.
Nothing here touches the swarm: the tokenizer runs on the API's loop, as completions' does.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from corolla.api.chat import render
from corolla.api.chat_protocol import template_messages, template_tools
from corolla.api.extra_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from corolla.api.protocol import ErrorResponse, ModelCard
from corolla.version import __version__

if TYPE_CHECKING:
    from corolla.api.http import Answer, Generate
    from corolla.api.serving import OpenAIServing


class UtilityServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    def model_card(self, model_id: str) -> ModelCard | ErrorResponse:
        card = next((card for card in self.serving.models().data if card.id == model_id), None)
        if card is None:
            return model_not_found(model_id, self.serving.name)
        return card

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse | ErrorResponse:
        body = request.root
        tokenizer = self.serving.model.tokenizer
        if isinstance(body, TokenizeChatRequest):
            text = render(
                tokenizer,
                template_messages(body.messages),
                template_tools(body.tools),
                body.add_generation_prompt,
            )
            if isinstance(text, ErrorResponse):
                return text
        else:
            text = body.prompt
        ids = tokenizer(text, add_special_tokens=body.add_special_tokens).input_ids
        return TokenizeResponse(count=len(ids), max_model_len=self.serving.max_model_len, tokens=ids)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse | ErrorResponse:
        vocab = self.serving.model.config.vocab_size
        if any(not 0 <= t < vocab for t in request.tokens):
            return _invalid(f"tokens holds ids outside the vocabulary of {vocab}", "tokens")
        try:
            text = self.serving.model.tokenizer.decode(request.tokens, clean_up_tokenization_spaces=False)
        except Exception as e:  # ids the config counts but the tokenizer lacks (a padded vocabulary)
            return _invalid(f"the tokenizer cannot decode these tokens: {e}", "tokens")
        return DetokenizeResponse(prompt=text)


def version() -> str:
    """corolla's installed version (the source's own when it runs from a checkout without metadata)."""
    try:
        return importlib.metadata.version("corolla")
    except importlib.metadata.PackageNotFoundError:
        return __version__


def model_not_found(given: str, served: str) -> ErrorResponse:
    return ErrorResponse.make(
        404,
        f"model {given!r} does not exist; this server serves {served!r}",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def _invalid(message: str, param: str) -> ErrorResponse:
    return ErrorResponse.make(400, message, "invalid_request_error", param)


def install_routes(app: FastAPI, generate: Generate, answer: Answer, serving: OpenAIServing) -> None:
    """Register the routes; bodies go through app.py's `generate` (parsed, model checked when given)."""
    utility = UtilityServing(serving)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return answer("models", utility.model_card(model_id))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await generate(request, "tokenize", TokenizeRequest, utility.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await generate(request, "detokenize", DetokenizeRequest, utility.detokenize)

    @app.get("/version")
    async def get_version() -> Response:
        return JSONResponse({"version": version()})
