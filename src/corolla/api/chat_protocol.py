"""Chat completions' request models (pydantic): messages, tools, tool calls and tool choice.

A conversation with tools, in OpenAI's shape: `tools` lists function definitions (a JSON schema of
their parameters); an assistant turn may carry `tool_calls` (arguments as a JSON string); a `tool` turn
answers one call by its id. `template_messages` turns them into what chat templates take (arguments as
objects, as transformers documents).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from corolla.api.protocol import OpenAIBaseModel, SamplingRequest

FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
MAX_TOOLS = 128


class TextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIBaseModel):
    name: FunctionName
    arguments: str  # JSON, as the model wrote it

    @field_validator("arguments")
    @classmethod
    def _check_arguments(cls, arguments: str) -> str:
        try:
            json.loads(arguments)
        except ValueError as e:
            raise ValueError(f"arguments must be a JSON string: {e}") from None
        return arguments


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, Field(validate_default=True)] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns
    tool_call_id: Annotated[str | None, Field(validate_default=True)] = None  # tool turns: what it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(
                    f"content parts of type {kind[:40]!r} (images, audio, files) are not supported: this "
                    "model reads text only"
                )
        return content

    @field_validator("content", mode="after")
    @classmethod
    def _check_content(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None and info.data.get("role") != "assistant":
            raise ValueError(f"a {info.data.get('role')} message needs content")
        return content

    @field_validator("tool_calls", mode="after")
    @classmethod
    def _check_calls(cls, calls: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if calls and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return calls

    @field_validator("tool_call_id", mode="after")
    @classmethod
    def _check_call_id(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("role") == "tool" and not call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return call_id

    @model_validator(mode="after")
    def _check_assistant(self) -> ChatMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionDefinition(OpenAIBaseModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: FunctionName


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's older name for the same limit
    parallel_tool_calls: bool = True
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError("tools: function names must be unique")
        if self.tool_choice is not None and self.tool_choice != "none" and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (to be parsed out of the text)."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)

    def template_tools(self) -> list[dict[str, Any]] | None:
        return template_tools(self.tools)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates take them (`developer` is the newer name of `system`; tool calls'
    arguments as objects): what chat completions and /tokenize render."""
    return [_template_message(m) for m in messages]


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def _template_message(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text(),
    }
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        rendered["name"] = message.name
    return rendered
