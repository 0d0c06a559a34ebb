"""Anthropic's Messages API requests (`/v1/messages`, `/v1/messages/count_tokens`), checked, and their
translation into the chat completions corolla's serving runs (api/anthropic.py answers in Anthropic's
shapes).

Content blocks: `text`, `tool_use` (an assistant's call: a chat tool call with its input as JSON
arguments) and `tool_result` (a user turn's answer to a call: a `tool` message); images, documents and
built-in (server) tools are refused naming the block. Tools are `{name, description, input_schema}`;
`tool_choice` auto, any (a call is required), tool (that one) or none, and `disable_parallel_tool_use`.
`output_config.format` (a JSON schema) is enforced as `response_format` is. The current anthropic SDKs
send no sampling parameters of their own (they come as extra body fields): `temperature` (0 to 1),
`top_p` and `top_k` are honoured when present; without them sampling is plain (temperature 1, no top-p or
top-k), as Anthropic's API defaults. Extended thinking (`enabled`) is refused, `adaptive` thinking is
taken (the model thinks when it decides to, and this one never does); `metadata`, `service_tier`, effort and
other fields that tune Anthropic's own service are ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from corolla.api.chat_protocol import ChatCompletionRequest
from corolla.errors import InvalidRequest


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Block(AnthropicModel):
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool = False


class Message(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(AnthropicModel):
    type: str | None = None  # "custom", or absent; anything else is a built-in tool
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(AnthropicModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(AnthropicModel):
    format: OutputFormat | None = None


class Thinking(AnthropicModel):
    type: str


class CountTokensRequest(AnthropicModel):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def chat_fields(self) -> dict[str, Any]:
        """The chat completion's messages, tools and tool choice; raises InvalidRequest naming the field."""
        if self.thinking is not None and self.thinking.type not in ("disabled", "adaptive"):
            # adaptive: the model thinks when it decides to, and this one never does
            raise InvalidRequest("thinking: this model has no extended thinking")
        messages = [{"role": "system", "content": _text(self.system, "system")}] if self.system else []
        for i, message in enumerate(self.messages):
            messages += _turns(i, message)
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            fields["tools"] = [_tool(i, tool) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            fields.update(_choice(self.tool_choice))
        return fields


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None  # None: the API's default (1.0)
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] | None = None
    output_config: OutputConfig | None = None
    ignore_eos: bool = (
        False  # corolla's extension, as on chat completions (benchmarks: answers of set length)
    )

    def to_openai(self) -> ChatCompletionRequest:
        fields = self.chat_fields()
        fields.update(
            max_tokens=self.max_tokens,
            stop=self.stop_sequences,
            stream=self.stream,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k or None,
            ignore_eos=self.ignore_eos,
        )
        if self.stream:
            fields["stream_options"] = {"include_usage": True}  # message_delta carries the counts
        if self.output_config is not None and self.output_config.format is not None:
            schema = {"name": "output", "schema": self.output_config.format.schema_, "strict": True}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        return ChatCompletionRequest.model_validate(fields)


def _turns(index: int, message: Message) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: tool results become tool messages (before the user's text)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        where = f"messages[{index}].content[{j}]"
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "tool_use" and message.role == "assistant":
            arguments = json.dumps(block.input or {})
            calls.append(
                {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
            )
        elif block.type == "tool_result" and message.role == "user":
            answer = _text(block.content, where) if block.content is not None else ""
            results.append(
                {"role": "tool", "tool_call_id": block.tool_use_id, "content": _errored(answer, block)}
            )
        elif block.type in ("thinking", "redacted_thinking"):
            continue  # an earlier answer's thinking: nothing to render
        else:
            raise InvalidRequest(f"{where}: {block.type!r} blocks are not supported in {message.role} turns")
    turns = list(results)
    if texts or calls or not results:
        turn: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        turns.append(turn)
    return turns


def _errored(answer: str, block: Block) -> str:
    return f"Error: {answer}" if block.is_error else answer


def _text(content: str | list[Block], where: str) -> str:
    if isinstance(content, str):
        return content
    if any(block.type != "text" for block in content):
        raise InvalidRequest(f"{where}: only text blocks are supported here")
    return "".join(block.text or "" for block in content)


def _tool(index: int, tool: AnthropicTool) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise InvalidRequest(
            f"tools[{index}]: built-in tools ({tool.type}) are not supported; define a function"
        )
    function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
    return {"type": "function", "function": function}


def _choice(choice: ToolChoice) -> dict[str, Any]:
    fields: dict[str, Any] = {"parallel_tool_calls": not choice.disable_parallel_tool_use}
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest("tool_choice.name: a tool choice of type tool names the tool")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields
