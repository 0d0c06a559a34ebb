"""Tool calling: which chat templates render tools, in which format their models write calls, and the
grammar that forces calls.

Tools reach the model through its own chat template (transformers renders `tools`); a template that
never reads `tools` would drop them silently, so such a model refuses requests with tools (400). The
template also tells the call format (api/tool_calls.py): Hermes `<tool_call>` markers, or Llama 3's
bare JSON. With `tool_choice` "required" or a named function, a Lark grammar with the functions'
parameter schemas embedded (decoding/constraints.py) makes the output exactly such calls; with "auto" the
model chooses, and whatever calls it wrote are parsed out.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import jinja2
import jinja2.meta

from corolla.api.chat_protocol import ChatCompletionRequest, NamedToolChoice
from corolla.api.tool_calls import HERMES, LLAMA3_JSON, CallFormat
from corolla.decoding.constraints import JSON_OPTIONS, lark_grammar

logger = logging.getLogger(__name__)


def supports_tools(chat_template: str | dict[str, str] | None) -> bool:
    """Whether the template reads the `tools` variable (else tools would silently vanish)."""
    return any(_reads_tools(template) for template in _templates(chat_template))


@functools.lru_cache(maxsize=16)
def _reads_tools(template: str) -> bool:
    """Whether one template reads `tools`; parsed once per template, not with every request."""
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False


def call_format(chat_template: str | dict[str, str] | None) -> CallFormat:
    """How the template's model writes calls: Hermes markers where the template shows them, Llama 3's
    bare JSON where it asks for `parameters` (Llama 3.1-3.3 templates), else Hermes (the commonest)."""
    return _format_of("\n".join(_templates(chat_template)))


@functools.lru_cache(maxsize=16)
def _format_of(text: str) -> CallFormat:
    """The call format of the templates' text; read once, so its log line comes once, not per request."""
    if HERMES.start in text:
        return HERMES
    if '"parameters"' in text and ("<|eot_id|>" in text or "<|python_tag|>" in text):
        return LLAMA3_JSON
    logger.info("The chat template names no known tool-call format: reading calls as Hermes'")
    return HERMES


def _templates(chat_template: str | dict[str, str] | None) -> list[str]:
    """A tokenizer's chat templates (some have several by name, e.g. "default" and "tool_use")."""
    return list(chat_template.values()) if isinstance(chat_template, dict) else [chat_template or ""]


def call_grammar(
    request: ChatCompletionRequest,
    answer: dict[str, Any] | bool | None,
    tokenizer: Any = None,
    fmt: CallFormat = HERMES,
) -> str | None:
    """The grammar of the answer: calls only (tool_choice "required" or named), or with "auto" and a
    JSON schema for answers (`answer`, from response_format), calls or such an answer; None when the
    model is free or only the response format applies. Raises InvalidRequest."""
    choice = request.tool_choice
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if not request.tools or choice == "none" or not (forced or answer is not None):
        return None
    if forced and isinstance(choice, NamedToolChoice):
        tools = [t for t in request.tools if t.function.name == choice.function.name]
    else:
        tools = request.tools
    one_call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, fmt.arguments: t.function.parameters},
                "required": ["name", fmt.arguments],
                "additionalProperties": False,
            }
            for t in tools
        ],
        "x-guidance": JSON_OPTIONS,
    }
    # a named function is called once (as OpenAI's named tool_choice); "required" may call several
    several = fmt.parallel and request.parallel_tool_calls and not isinstance(choice, NamedToolChoice)
    calls = 'call ("\\n" call)*' if several else "call"
    call = f"%json {json.dumps(one_call)}"
    if fmt.start:
        call = f'{_marker(tokenizer, fmt.start)} "\\n" {call} "\\n" {_marker(tokenizer, fmt.end)}'
    lines = [f"calls: {calls}", f"call: {call}"]
    if forced:
        return lark_grammar("\n".join(["start: calls", *lines]))
    schema = {"x-guidance": JSON_OPTIONS, **answer} if isinstance(answer, dict) else answer
    return lark_grammar("\n".join(["start: calls | answer", *lines, f"answer: %json {json.dumps(schema)}"]))


def _marker(tokenizer: Any, text: str) -> str:
    """`text` in the grammar: as its token too where the tokenizer has one (llguidance reads added tokens
    as special ones, matched by id, not by their text), else as text."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return f'("{text}" | <[{added[text]}]>)' if text in added else f'"{text}"'
