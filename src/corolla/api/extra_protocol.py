"""Wire models (pydantic) of the endpoints beside completions: embeddings, tokenize and detokenize.

Embeddings follow https://platform.openai.com/docs/api-reference/embeddings; tokenize and detokenize
follow vLLM's routes of those names (a request is a prompt or a chat; `model` may be left out). Like
protocol.py's models, they ignore unknown fields with a log line. Checks that need the tokenizer (empty
or too long inputs, token ids outside the vocabulary) are the serving layer's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, RootModel, Tag, field_validator

from corolla.api.chat_protocol import MAX_TOOLS, ChatMessage, Tool
from corolla.api.protocol import OpenAIBaseModel

MAX_INPUTS = 64  # inputs per embeddings request, as MAX_CHOICES bounds completions


class EmbeddingRequest(OpenAIBaseModel):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, unused (OpenAI's abuse tracking)

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("input must not be empty")
        if isinstance(value, list) and not isinstance(value[0], int) and len(value) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs per request, got {len(value)}")
        return value

    @field_validator("dimensions")
    @classmethod
    def _check_dimensions(cls, value: int | None) -> None:
        if value is not None:
            raise ValueError(
                "dimensions is not supported: embeddings have the model's hidden size (leave it out)"
            )

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or a list of token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if isinstance(value[0], int):
            return [list(value)]
        return list(value)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # floats, or base64 of their little-endian float32 bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# --- tokenize and detokenize (vLLM's shapes) ----------------------------------------------------------


class TokenizePromptRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template writes the special tokens itself
    prompt: str | None = None  # only to refuse a request that has both

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("give either prompt (a text) or messages (a chat), not both")


def _tokenize_kind(body: Any) -> str | None:
    """Which kind of tokenize request a body is: a chat when it has messages, else a prompt."""
    if not isinstance(body, dict):
        return None
    return "Chat" if "messages" in body else "Prompt"


class TokenizeRequest(RootModel):
    """A prompt or a chat, told apart by `messages` (pydantic then reports the errors of that kind only;
    the capitalized tags are dropped from error locations like pydantic's own union tags)."""

    root: Annotated[
        Annotated[TokenizePromptRequest, Tag("Prompt")] | Annotated[TokenizeChatRequest, Tag("Chat")],
        Discriminator(_tokenize_kind),
    ]

    @property
    def model(self) -> str | None:
        return self.root.model


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
