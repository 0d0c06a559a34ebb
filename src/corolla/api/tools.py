"""Tool calling: which chat templates render tools, the grammar that forces a call, and calls parsed out
of the generated text (whole, or as they stream).

Tools reach the model through its own chat template (transformers renders `tools`); a template that
never reads `tools` would drop them silently, so such a model refuses requests with tools (400). The
model writes calls in the Hermes convention that Qwen2/2.5/3, Hermes and many other tool-calling models
are trained on: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one per call. With
`tool_choice` "required" or a named function, a Lark grammar with the functions' parameter schemas
embedded (client/constraints.py) makes the output exactly such calls; with "auto" the model chooses,
and whatever calls it wrote are parsed out.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import jinja2
import jinja2.meta

from corolla.api.chat_protocol import ChatCompletionRequest, FunctionCall, NamedToolChoice, ToolCall
from corolla.client.constraints import JSON_OPTIONS, lark_grammar

START, END = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(START) + r"\s*(.*?)\s*" + re.escape(END), re.DOTALL)


def supports_tools(chat_template: str | dict[str, str] | None) -> bool:
    """Whether the template reads the `tools` variable (else tools would silently vanish)."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    environment = jinja2.Environment()
    for template in templates:
        try:
            if "tools" in jinja2.meta.find_undeclared_variables(environment.parse(template)):
                return True
        except jinja2.TemplateSyntaxError:
            continue
    return False


def call_grammar(
    request: ChatCompletionRequest, answer: dict[str, Any] | bool | None, tokenizer: Any = None
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
                "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ],
        "x-guidance": JSON_OPTIONS,
    }
    # a named function is called once (as OpenAI's named tool_choice); "required" may call several
    several = request.parallel_tool_calls and not isinstance(choice, NamedToolChoice)
    calls = 'call ("\\n" call)*' if several else "call"
    start, end = _marker(tokenizer, START), _marker(tokenizer, END)
    lines = [f"calls: {calls}", f'call: {start} "\\n" %json {json.dumps(one_call)} "\\n" {end}']
    if forced:
        return lark_grammar("\n".join(["start: calls", *lines]))
    schema = {"x-guidance": JSON_OPTIONS, **answer} if isinstance(answer, dict) else answer
    return lark_grammar("\n".join(["start: calls | answer", *lines, f"answer: %json {json.dumps(schema)}"]))


def _marker(tokenizer: Any, text: str) -> str:
    """`text` in the grammar: as its token too where the tokenizer has one (llguidance reads added tokens
    as special ones, matched by id, not by their text), else as text."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return f'("{text}" | <[{added[text]}]>)' if text in added else f'"{text}"'


def new_call(body: str) -> ToolCall | None:
    """The call written as `body` ({"name": ..., "arguments": {...}}), or None if it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    try:
        function = FunctionCall(name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False))
    except ValueError:  # a name no function could have
        return None
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=function)


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer -> (its content outside the calls, or None; the calls). A call left unfinished at
    the end (the answer ran out of tokens) is not content: it is dropped."""
    calls, kept, last = [], [], 0
    for match in CALL.finditer(text):
        call = new_call(match.group(1))
        if call is None:
            continue  # not a call after all: it stays in the content
        calls.append(call)
        kept.append(text[last : match.start()])
        last = match.end()
    rest = text[last:]
    unfinished = rest.rfind(START)
    if unfinished >= 0 and END in rest[unfinished:]:
        unfinished = -1  # a finished call that is not one (it stays in the content)
    kept.append(rest if unfinished < 0 else rest[:unfinished])
    content = "".join(kept).strip() if calls or unfinished >= 0 else text
    return content or None, calls


class CallStream:
    """Separates one choice's streamed text into content deltas and completed calls: text that may be
    the start of a call is held back until the call ends (or turns out not to be one)."""

    def __init__(self) -> None:
        self.pending, self.inside, self.count = "", False, 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content this text releases (whitespace between calls dropped) and the calls it ends."""
        self.pending += text
        content, calls = [], []
        while True:
            if not self.inside:
                start = self.pending.find(START)
                cut = len(self.pending) - _partial_suffix(self.pending, START) if start < 0 else start
                content.append(self._content(self.pending[:cut]))
                self.pending, self.inside = self.pending[cut:], start >= 0
                if start < 0:
                    break
            end = self.pending.find(END)
            if end < 0:
                break
            call = new_call(self.pending[len(START) : end].strip())
            if call is None:
                content.append(self.pending[: end + len(END)])
            else:
                calls.append(call)
                self.count += 1
            self.pending, self.inside = self.pending[end + len(END) :], False
        return "".join(content), calls

    def _content(self, text: str) -> str:
        return "" if self.count and not text.strip() else text

    def finish(self) -> str:
        """What is left once the choice ends (an unfinished call is dropped, as `parse` drops it)."""
        rest, inside, self.pending, self.inside = self.pending, self.inside, "", False
        return "" if inside else self._content(rest)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
