"""The OpenAI API's response and stream-chunk models (pydantic), completions and chat, in OpenAI's
field order; built by api/formats.py."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from corolla.api.chat_protocol import FunctionCall, ToolCall


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the servers held already (reused prefixes): not recomputed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: Annotated[list[ToolCall] | None, Field(exclude_if=lambda calls: calls is None)] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(BaseModel):
    """A call in a stream: sent whole, in one chunk, once the model has finished writing it."""

    index: int  # among the choice's calls
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: Annotated[list[ToolCallDelta] | None, Field(exclude_if=lambda calls: calls is None)] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ServedHop(BaseModel):
    peer_id: str
    blocks: tuple[int, int]  # [start, end)


class RoutedChunk(ChatCompletionChunk):
    """A chunk of a request with corolla's `return_servers`: the chain of servers that computed its token."""

    servers: list[ServedHop]
