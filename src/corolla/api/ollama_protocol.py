"""Ollama's request shapes (`/api/chat`, `/api/generate`, `/api/show`), checked, and their translation into
the OpenAI requests that corolla's serving runs (api/ollama.py answers in Ollama's shapes).

Options map onto corolla's sampling: temperature, top_p, top_k, seed, stop, num_predict (max tokens; -1
and -2: up to the context), repeat_penalty (transformers' repetition penalty, over the whole text rather
than Ollama's last 64 tokens), presence_penalty, frequency_penalty. Without them, sampling follows Ollama's
own defaults (temperature 0.8, top_p 0.9, top_k 40; no repetition penalty). Options that tune Ollama's
runner (num_ctx, num_gpu, num_thread, mirostat, ...) are accepted and ignored, as Ollama ignores options a
model does not use; images and thinking are refused (the swarm serves text, and no thinking mode).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from corolla.api.chat_protocol import ChatCompletionRequest
from corolla.api.protocol import CompletionRequest
from corolla.errors import InvalidRequest

DEFAULTS = {"temperature": 0.8, "top_p": 0.9, "top_k": 40}  # Ollama's, where a request says nothing


class OllamaModel(BaseModel):
    model_config = ConfigDict(extra="ignore")  # Ollama ignores fields it does not know


class Options(OllamaModel):
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # 0: no top-k
    seed: int | None = None
    stop: list[str] | None = None
    num_predict: Annotated[int, Field(ge=-2)] | None = None  # -1: no limit; -2: fill the context
    repeat_penalty: Annotated[float, Field(gt=0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None

    def sampling(self) -> dict[str, Any]:
        """corolla's sampling fields for these options (Ollama's defaults where they say nothing)."""
        top_k = DEFAULTS["top_k"] if self.top_k is None else self.top_k
        fields: dict[str, Any] = {
            "temperature": DEFAULTS["temperature"] if self.temperature is None else self.temperature,
            "top_p": DEFAULTS["top_p"] if self.top_p is None else self.top_p,
            "top_k": top_k or None,
            "seed": self.seed,
            "stop": self.stop,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": self.repeat_penalty or 1.0,
        }
        fields["max_tokens"] = self.num_predict if self.num_predict and self.num_predict > 0 else None
        return fields


class ToolFunctionCall(OllamaModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(OllamaModel):
    function: ToolFunctionCall


class OllamaMessage(OllamaModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None  # a tool message: the tool it answers for


class GenerationRequest(OllamaModel):
    model: str
    format: Literal["json"] | dict[str, Any] | None = None  # "json", or a JSON schema
    options: Options = Field(default_factory=Options)
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: str | float | None = None  # how long Ollama keeps a model loaded: nothing to do here
    think: bool | str | None = None

    def common(self) -> dict[str, Any]:
        if self.think:
            raise InvalidRequest(f"think: {self.model} has no thinking mode")
        fields = {"model": self.model, "stream": self.stream, **self.options.sampling()}
        if self.stream:
            fields["stream_options"] = {"include_usage": True}  # the last line carries the counts
        if self.format == "json":
            fields["response_format"] = {"type": "json_object"}
        elif self.format is not None:
            schema = {"name": "format", "schema": self.format, "strict": True}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        return fields


class OllamaChatRequest(GenerationRequest):
    messages: Annotated[list[OllamaMessage], Field(min_length=1)]
    tools: list[dict[str, Any]] | None = None  # OpenAI's function tools, as Ollama takes them

    def to_openai(self) -> ChatCompletionRequest:
        """The chat completion this chat asks for; raises InvalidRequest naming the field at fault."""
        messages = [_message(i, message) for i, message in enumerate(self.messages)]
        _link_tool_answers(messages)
        return ChatCompletionRequest.model_validate(
            {**self.common(), "messages": messages, "tools": self.tools or None}
        )


class OllamaGenerateRequest(GenerationRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False  # the prompt as it is, without the chat template
    suffix: str | None = None
    images: list[str] | None = None

    def to_openai(self, tokenizer: Any) -> CompletionRequest:
        """The completion this asks for: the prompt through the model's chat template (with `system`),
        unless `raw`."""
        if self.images:
            raise InvalidRequest("images: this swarm serves text only")
        if self.suffix:
            raise InvalidRequest("suffix: fill-in-the-middle is not supported")
        prompt = self.prompt
        if not self.raw:
            turns = [{"role": "system", "content": self.system}] if self.system else []
            turns.append({"role": "user", "content": self.prompt})
            prompt = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        return CompletionRequest.model_validate({**self.common(), "prompt": prompt})


class ShowRequest(OllamaModel):
    model: str


def _message(index: int, message: OllamaMessage) -> dict[str, Any]:
    if message.images:
        raise InvalidRequest(f"messages[{index}].images: this swarm serves text only")
    converted: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        converted["tool_calls"] = [
            {
                "id": f"call_{index}_{i}",
                "type": "function",
                "function": {"name": call.function.name, "arguments": json.dumps(call.function.arguments)},
            }
            for i, call in enumerate(message.tool_calls)
        ]
    if message.tool_name:
        converted["name"] = message.tool_name
    return converted


def _link_tool_answers(messages: list[dict[str, Any]]) -> None:
    """Ollama's tool messages name the tool, not the call: each answers the earliest unanswered call of
    that tool (else the earliest unanswered call) of the assistant turns before it."""
    open_calls: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        open_calls += message.get("tool_calls", [])
        if message["role"] != "tool":
            continue
        name = message.get("name")
        call = next(
            (c for c in open_calls if c["function"]["name"] == name), open_calls[0] if open_calls else None
        )
        if call is None:
            raise InvalidRequest(f"messages[{index}]: a tool message with no tool call before it to answer")
        open_calls.remove(call)
        message["tool_call_id"] = call["id"]
