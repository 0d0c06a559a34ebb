"""Ollama's response shapes for corolla's answers (api/ollama.py): one JSON object per line while
streaming, the last one `done` with the counts and durations in nanoseconds; tool calls with their
arguments as objects. They extend OpenAI's chat and completion formats (api/formats.py), so a chat's
tool calls, stop strings and finish reasons are worked out once."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from corolla.api.choices import Choice, Moved
from corolla.api.formats import ChatFormat, CompletionFormat

NDJSON = "application/x-ndjson"


class _Lines:
    """What Ollama's formats share: JSON lines, no end marker, the final line's counts and durations."""

    media_type = NDJSON
    stream_end = ""
    model: str
    prompt_tokens: int
    first_token_at: float | None

    def start_clock(self) -> None:
        self.started = time.perf_counter()

    def sse(self, payload: Any) -> str:
        if isinstance(payload, dict) and "error" in payload:  # serving's error event, OpenAI-shaped
            payload = {"error": payload["error"]["message"]}
        return json.dumps(payload, ensure_ascii=False) + "\n"

    def line(self, **fields: Any) -> dict[str, Any]:
        return {"model": self.model, "created_at": now(), **fields}

    def done(self, choices: list[Choice], **fields: Any) -> dict[str, Any]:
        now = time.perf_counter()
        first = self.first_token_at or now
        reason = choices[0].text.finish_reason if choices else None
        return self.line(
            **fields,
            done=True,
            done_reason="length" if reason == "length" else "stop",
            total_duration=_ns(now - self.started),
            load_duration=0,
            prompt_eval_count=self.prompt_tokens,
            prompt_eval_duration=_ns(first - self.started),
            eval_count=sum(len(choice.text.token_ids) for choice in choices),
            eval_duration=_ns(now - first),
        )


class OllamaChatFormat(_Lines, ChatFormat):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.start_clock()

    def first_chunks(self, num_choices: int) -> list[Any]:
        return []

    def chunks(self, moved: list[Moved]) -> list[dict[str, Any]]:
        lines = []
        for chunk in super().chunks(moved):
            delta = chunk.choices[0].delta
            message: dict[str, Any] = {"role": "assistant", "content": delta.content or ""}
            if delta.tool_calls:
                message["tool_calls"] = [tool_call(c.function) for c in delta.tool_calls]
            lines.append(self.line(message=message, done=False))
        return lines

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        return self.done(choices, message={"role": "assistant", "content": ""})

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        message = super().response(choices).choices[0].message
        answer: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
        if message.tool_calls:
            answer["tool_calls"] = [tool_call(call.function) for call in message.tool_calls]
        return self.done(choices, message=answer)


class OllamaGenerateFormat(_Lines, CompletionFormat):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.start_clock()

    def chunks(self, moved: list[Moved]) -> list[dict[str, Any]]:
        return [self.line(response=text, done=False) for _, text, _ in moved]

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        return self.done(choices, response="")

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        return self.done(choices, response=choices[0].text.text)


def tool_call(function: Any) -> dict[str, Any]:
    """A tool call as Ollama writes it: the arguments as an object, not a JSON string."""
    return {"function": {"name": function.name, "arguments": json.loads(function.arguments or "{}")}}


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))
