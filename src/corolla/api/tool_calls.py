"""Tool calls read out of generated text, whole or as it streams, in the format the model writes them.

Two formats cover most tool-calling models. Hermes (Qwen2/2.5/3, Hermes, many fine-tunes): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several may follow each other, text may come
before. Llama 3.1-3.3's JSON tool calling: the whole answer is one `{"name": ..., "parameters": {...}}`.
Either key is accepted in both. Text that is not a call stays content; a call cut off by max_tokens is
dropped (it is not content either).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from corolla.api.chat_protocol import FunctionCall, ToolCall


@dataclass(frozen=True)
class CallFormat:
    name: str
    start: str  # what opens a call ("": the answer is one bare JSON call)
    end: str  # what closes it
    arguments: str  # the key of the arguments object
    parallel: bool  # whether several calls may follow each other


HERMES = CallFormat("hermes", "<tool_call>", "</tool_call>", "arguments", parallel=True)
LLAMA3_JSON = CallFormat("llama3_json", "", "", "parameters", parallel=False)


def new_call(body: str) -> ToolCall | None:
    """The call written as `body` ({"name": ..., "arguments" or "parameters": {...}}), or None."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if not ({"arguments", "parameters"} & set(value)) and set(value) != {"name"}:
        return None  # some other JSON object that happens to have a name
    arguments = value.get("arguments", value.get("parameters", {}))
    try:
        function = FunctionCall(name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False))
    except ValueError:  # a name no function could have
        return None
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=function)


def parse(text: str, fmt: CallFormat = HERMES) -> tuple[str | None, list[ToolCall]]:
    """A whole answer -> (its content outside the calls, or None; the calls)."""
    if not fmt.start:
        call = new_call(text.strip()) if text.lstrip().startswith("{") else None
        return (None, [call]) if call is not None else (text or None, [])
    pattern = re.compile(re.escape(fmt.start) + r"\s*(.*?)\s*" + re.escape(fmt.end), re.DOTALL)
    calls = []
    kept = []
    last = 0
    for match in pattern.finditer(text):
        call = new_call(match.group(1))
        if call is None:
            continue  # not a call after all: it stays in the content
        calls.append(call)
        kept.append(text[last : match.start()])
        last = match.end()
    rest = text[last:]
    unfinished = rest.rfind(fmt.start)
    if unfinished >= 0 and fmt.end in rest[unfinished:]:
        unfinished = -1  # a finished call that is not one (it stays in the content)
    kept.append(rest if unfinished < 0 else rest[:unfinished])
    content = "".join(kept).strip() if calls or unfinished >= 0 else text
    return content or None, calls


class CallStream:
    """Separates one choice's streamed text into content deltas and completed calls: text that may be
    (the start of) a call is held back until the call ends or turns out not to be one."""

    def __init__(self, fmt: CallFormat = HERMES) -> None:
        self.format = fmt
        self.pending = ""
        self.inside = False
        self.count = 0
        self.plain = False  # a bare-JSON format's answer that turned out to be text

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content this text releases (whitespace between calls dropped) and the calls it ends."""
        self.pending += text
        if not self.format.start:
            return self._feed_bare()
        start = self.format.start
        end = self.format.end
        content = []
        calls = []
        while True:
            if not self.inside:
                found = self.pending.find(start)
                cut = len(self.pending) - _partial_suffix(self.pending, start) if found < 0 else found
                content.append(self._content(self.pending[:cut]))
                self.pending = self.pending[cut:]
                self.inside = found >= 0
                if found < 0:
                    break
            closed = self.pending.find(end)
            if closed < 0:
                break
            call = new_call(self.pending[len(start) : closed].strip())
            if call is None:
                content.append(self.pending[: closed + len(end)])
            else:
                calls.append(call)
                self.count += 1
            self.pending = self.pending[closed + len(end) :]
            self.inside = False
        return "".join(content), calls

    def _feed_bare(self) -> tuple[str, list[ToolCall]]:
        """A bare JSON call is the whole answer: an answer opening with `{` is held to the end."""
        head = self.pending.lstrip()
        if self.inside or not head:
            return "", []
        if head.startswith("{") and not self.plain:
            self.inside = True
            return "", []
        self.plain = True
        released = self.pending
        self.pending = ""
        return released, []

    def _content(self, text: str) -> str:
        return "" if self.count and not text.strip() else text

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left once the choice ends: content, and (bare JSON) the call; an unfinished call is
        dropped, as `parse` drops it."""
        rest = self.pending
        inside = self.inside
        self.pending = ""
        self.inside = False
        if not self.format.start:
            content, calls = parse(rest, self.format)
            self.count += len(calls)
            return content or "", calls
        return ("" if inside else self._content(rest)), []


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
