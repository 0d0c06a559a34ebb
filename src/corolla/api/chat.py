"""A chat request's prompt and grammar: messages (and tools) through the model's chat template, and
what constrained decoding must enforce (tool calls, response format)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import jinja2

from corolla.api.chat_protocol import ChatCompletionRequest
from corolla.api.protocol import ErrorResponse, SamplingRequest
from corolla.api.tool_calls import HERMES, CallFormat
from corolla.api.tools import call_format, call_grammar, supports_tools
from corolla.errors import InvalidRequest

BUNDLED_TEMPLATES = ("chatml-tools",)


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    grammar: str | None  # llguidance's, or None: free text
    calls: CallFormat | None = None  # how the model writes tool calls, when the answer may hold some


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    generation_prompt: bool,
) -> str | ErrorResponse:
    """The chat as the model's template writes it, or the 400 naming the field at fault: the model has no
    template, its template ignores tools, or it rejects the messages (e.g. two system messages)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return invalid("this model has no chat template; use /v1/completions", "messages")
    if tools and not supports_tools(template):
        return invalid(
            "this model's chat template does not support tools (it never renders them); send the request "
            "without tools, or serve a model whose template does",
            "tools",
        )
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as e:  # templates raise what they like (jinja2's errors, raise_exception)
        return invalid(f"the chat template rejected the messages: {e}", "messages")


def chat_template(value: str) -> str:
    """`--chat-template`'s text: a bundled template's name (`chatml-tools`: ChatML with Hermes tool calls,
    for ChatML models whose own template renders no tools) or a Jinja file; InvalidRequest if unusable."""
    try:
        if value in BUNDLED_TEMPLATES:
            text = files("corolla.api").joinpath(f"{value}.jinja").read_text()
        else:
            text = Path(value).read_text()
    except OSError as e:
        choices = ", ".join(BUNDLED_TEMPLATES)
        raise InvalidRequest(
            f"chat_template (--chat-template): {e.strerror}: {value} (bundled: {choices})"
        ) from None
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequest(
            f"chat_template (--chat-template): {value}, line {e.lineno}: {e.message}"
        ) from None
    return text


def prepare(tokenizer: Any, request: ChatCompletionRequest) -> ChatPrompt | ErrorResponse:
    """The prompt's token ids and the answer's grammar, or the 400 naming what is wrong."""
    text = render(tokenizer, request.template_messages(), request.template_tools(), True)
    if isinstance(text, ErrorResponse):
        return text
    ids = tokenizer(text, add_special_tokens=False).input_ids
    answer = request.response_format.answer_schema() if request.response_format else None
    calls = call_format(tokenizer.chat_template) if request.calls_tools else None
    try:
        grammar = call_grammar(request, answer, tokenizer, calls or HERMES)
    except InvalidRequest as e:
        return invalid(f"the tools' parameter schemas: {e}", "tools")
    if grammar is not None:
        return ChatPrompt(ids, grammar, calls)
    formatted = format_grammar(request, request.token_limit)
    return formatted if isinstance(formatted, ErrorResponse) else ChatPrompt(ids, formatted, calls)


def format_grammar(request: SamplingRequest, max_tokens: int | None) -> str | None | ErrorResponse:
    """The response format's grammar (None for free text), its answers fitted to `max_tokens`, or the 400
    for a schema it cannot enforce."""
    try:
        return request.response_format.grammar(max_tokens) if request.response_format else None
    except InvalidRequest as e:
        return invalid(f"response_format: {e}", "response_format")


def invalid(message: str, param: str | None = None) -> ErrorResponse:
    return ErrorResponse.make(400, message, "invalid_request_error", param)
