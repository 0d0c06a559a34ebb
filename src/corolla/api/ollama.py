"""Ollama's API over the same serving as OpenAI's: `/api/chat`, `/api/generate` (streamed as JSON lines),
`/api/tags`, `/api/show` and `/api/version`, for Open WebUI, the ollama client and the tools built on them.

Each request is translated into a chat completion or a completion (api/ollama_protocol.py) and runs
through the one chat pipeline (templates, grammars, tools, prefix reuse, metrics, cancellation when the
client leaves); api/ollama_formats.py writes its answer in Ollama's shapes instead of OpenAI's. Errors
come back as `{"error": "..."}` naming the field; a model is named as served, or with the tag `:latest`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from corolla.api.dialects import Dialect, translated
from corolla.api.ollama_formats import OllamaChatFormat, OllamaGenerateFormat, now
from corolla.api.ollama_protocol import OllamaChatRequest, OllamaGenerateRequest, ShowRequest
from corolla.api.protocol import ErrorResponse
from corolla.api.tools import supports_tools
from corolla.api.utility import version

if TYPE_CHECKING:
    from corolla.api.serving import OpenAIServing


class OllamaServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.dialect = Dialect(serving, "ollama", lambda e: {"error": e.error.message}, self.names_served)

    def names_served(self, given: str) -> bool:
        """Ollama names models `name:tag`; `latest` is the tag a bare name means."""
        return given in (self.serving.name, f"{self.serving.name}:latest")

    def _defaults(self, body: OllamaChatRequest | OllamaGenerateRequest) -> None:
        """`corolla api --default-temperature`, where set, before Ollama's own default (0.8)."""
        if self.serving.default_temperature is not None and body.options.temperature is None:
            body.options.temperature = self.serving.default_temperature

    async def chat(self, body: OllamaChatRequest) -> Any:
        self._defaults(body)
        request = translated(body.to_openai)
        if isinstance(request, ErrorResponse):
            return request
        return await self.serving.create_chat_completion(request, OllamaChatFormat)

    async def generate(self, body: OllamaGenerateRequest) -> Any:
        if not body.prompt and not body.raw:  # Ollama's way to load a model: it is loaded already
            return {
                "model": body.model,
                "created_at": now(),
                "response": "",
                "done": True,
                "done_reason": "load",
            }
        self._defaults(body)
        request = translated(lambda: body.to_openai(self.serving.model.tokenizer))
        if isinstance(request, ErrorResponse):
            return request
        return await self.serving.create_completion(request, OllamaGenerateFormat)

    def tags(self) -> dict[str, Any]:
        return {"models": [self.card()]}

    async def show(self, body: ShowRequest) -> dict[str, Any]:
        config = self.serving.model.config
        kind = config.model_type
        template = getattr(self.serving.model.tokenizer, "chat_template", None) or ""
        return {
            "modelfile": "",
            "parameters": "",
            "template": template,
            "details": self.card()["details"],
            "model_info": {
                "general.architecture": kind,
                f"{kind}.context_length": self.serving.max_model_len,
                f"{kind}.block_count": config.num_hidden_layers,
                f"{kind}.embedding_length": config.hidden_size,
            },
            "capabilities": ["completion", "tools"]
            if template and supports_tools(template)
            else ["completion"],
        }

    def card(self) -> dict[str, Any]:
        kind = self.serving.model.config.model_type
        details = {
            "parent_model": "",
            "format": "corolla",
            "family": kind,
            "families": [kind],
            "parameter_size": "",
            "quantization_level": "",
        }
        name = self.serving.name
        return {
            "name": name,
            "model": name,
            "modified_at": now(),
            "size": 0,
            "digest": "",
            "details": details,
        }


def install_routes(app: FastAPI, serving: OpenAIServing) -> None:
    ollama = OllamaServing(serving)
    run = ollama.dialect.run
    reply = ollama.dialect.answer

    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        return await run(request, "chat", OllamaChatRequest, ollama.chat)

    @app.post("/api/generate")
    async def generate(request: Request) -> Response:
        return await run(request, "generate", OllamaGenerateRequest, ollama.generate)

    @app.post("/api/show")
    async def show(request: Request) -> Response:
        return await run(request, "show", ShowRequest, ollama.show)

    @app.get("/api/tags")
    async def tags() -> Response:
        return reply("tags", ollama.tags())

    @app.get("/api/version")
    async def ollama_version() -> Response:
        return reply("version", {"version": version()})
