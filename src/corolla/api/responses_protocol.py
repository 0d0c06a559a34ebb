"""OpenAI's Responses API requests (`POST /v1/responses`), checked, and their translation into the chat
completions corolla's serving runs (api/responses.py answers in the Responses API's shapes).

Input is a string (one user message) or items: messages (`input_text` / `output_text` parts), the
assistant's `function_call`s and their `function_call_output`s; earlier answers' `reasoning` items are
skipped (this model does not reason). Images, files, audio, item references and the items of built-in
tools are refused naming the item. `instructions` become a system message before the conversation (and,
as OpenAI documents, are not carried over by `previous_response_id`). Function tools with `tool_choice`,
`text.format` (json_schema, json_object) enforced as chat's `response_format`, `max_output_tokens`,
temperature and top_p (and corolla's extensions top_k, seed, ignore_eos). Built-in tools, background
runs, server-side conversations (`conversation`), stored prompts, `truncation: auto` and reasoning effort
are refused; `include`, `metadata`, `user`, `service_tier` and the prompt cache's hints are accepted (the
last two change nothing here).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from corolla.api.chat_protocol import MAX_TOOLS, ChatCompletionRequest, FunctionName
from corolla.api.protocol import OpenAIBaseModel
from corolla.api.responses_tools import ResponsesTool, function_tools, qualified
from corolla.errors import InvalidRequest

TEXT_PARTS = ("input_text", "output_text", "text")
SKIPPED_ITEMS = ("reasoning",)
LOGPROBS = "message.output_text.logprobs"  # the one `include` that adds to what is answered here


class Part(OpenAIBaseModel):
    type: str
    text: str | None = None


class MessageItem(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(OpenAIBaseModel):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: FunctionName
    arguments: str
    namespace: FunctionName | None = None  # the namespace tool whose function this calls


class FunctionOutputItem(OpenAIBaseModel):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: str | list[Part]


class OtherItem(OpenAIBaseModel):
    type: str


def _item_tag(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    tags = {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionOutput"}
    return tags.get(kind, "Other")


InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionOutputItem, Tag("FunctionOutput")]
    | Annotated[OtherItem, Tag("Other")],
    Discriminator(_item_tag),
]


class FunctionChoice(OpenAIBaseModel):
    type: str
    name: FunctionName | None = None
    namespace: FunctionName | None = None


class TextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] = "output"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> TextFormat:
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("a schema goes with type json_schema, and only with it")
        return self


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(OpenAIBaseModel):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None  # the served model when left out
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: Annotated[str, Field(max_length=128)] | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    tools: Annotated[list[ResponsesTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    user: str | None = None
    # corolla's extensions, as on chat completions
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool = False

    def check_supported(self) -> None:
        """Raise InvalidRequest naming a field this server cannot honour."""
        refused = {
            "background": "background runs are not supported; leave background out",
            "conversation": "server-side conversations are not supported; continue with previous_response_id",
            "prompt": "stored prompts are not supported; send the input itself",
        }
        for name, reason in refused.items():
            if getattr(self, name):
                raise InvalidRequest(f"{name}: {reason}")
        if self.truncation == "auto":
            raise InvalidRequest("truncation: auto is not supported; a conversation must fit the context")
        if self.reasoning is not None and self.reasoning.effort not in (None, "none"):
            model = self.model or "this model"
            raise InvalidRequest(f"reasoning.effort: {model} does not reason; leave it out")

    def new_items(self) -> list[dict[str, Any]]:
        """This turn's input as items (a string is one user message), as they are kept for later turns."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(by_alias=True, exclude_none=True) for item in self.input]

    def to_openai(self, history: list[dict[str, Any]], model: str) -> ChatCompletionRequest:
        """The chat completion of `history` (earlier turns' items) and this turn; raises InvalidRequest."""
        self.check_supported()
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += chat_messages(history, "previous_response_id")
        messages += chat_messages(self.new_items(), "input")
        fields: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "stream": self.stream,
            "top_k": self.top_k,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            **{k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p)) if v is not None},
        }
        if self.stream:
            fields["stream_options"] = {"include_usage": True}  # the last event carries the usage
        if LOGPROBS in (self.include or []):
            fields.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        fields.update(self._tool_fields())
        fields.update(self._format_fields())
        return ChatCompletionRequest.model_validate(fields)

    def _tool_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.tools:
            fields["tools"] = function_tools(self.tools)
        if self.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            if choice.type != "function" or choice.name is None:
                raise InvalidRequest(
                    f"tool_choice: {choice.type!r} choices are not supported; name a function"
                )
            name = qualified(choice.namespace, choice.name, "tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": name}}
        elif choice is not None:
            fields["tool_choice"] = choice
        return fields

    def _format_fields(self) -> dict[str, Any]:
        form = self.text.format if self.text is not None else None
        if form is None or form.type == "text":
            return {}
        if form.type == "json_object":
            return {"response_format": {"type": "json_object"}}
        schema = {"name": form.name, "description": form.description, "schema": form.schema_, "strict": True}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}


def chat_messages(items: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Items as chat messages: an assistant's function calls join its message (as one turn with
    tool_calls), each call's output is a tool message. Raises InvalidRequest naming `where[i]`."""
    messages: list[dict[str, Any]] = []
    calling = False  # whether the last message is an assistant turn that calls may join
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            text = _text(item["content"], f"{where}[{i}].content")
            messages.append({"role": item["role"], "content": text})
            calling = item["role"] == "assistant"
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function"}
            name = qualified(item.get("namespace"), item["name"], f"{where}[{i}]")
            call["function"] = {"name": name, "arguments": item["arguments"]}
            if not calling:
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
            calling = True
        elif kind == "function_call_output":
            text = _text(item["output"], f"{where}[{i}].output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
            calling = False
        elif kind not in SKIPPED_ITEMS:
            raise InvalidRequest(f"{where}[{i}]: items of type {kind!r} are not supported here")
    return messages


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part["type"] not in TEXT_PARTS:
            raise InvalidRequest(
                f"{where}[{j}]: {part['type']!r} parts are not supported: this model reads text only"
            )
    return "".join(part.get("text") or "" for part in content)
