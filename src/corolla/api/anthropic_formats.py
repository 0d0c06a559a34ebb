"""Anthropic's Messages API shapes for corolla's answers (api/anthropic.py): a message with content blocks
(text, tool_use), `stop_reason` and `usage`; streamed as Anthropic's named server-sent events
(message_start, content_block_start / _delta / _stop, message_delta, message_stop). Built on OpenAI's chat
format (api/formats.py), so tool calls, stop strings and finish reasons are worked out once."""

from __future__ import annotations

import json
from typing import Any

from corolla.api.choices import Choice, Moved
from corolla.api.formats import ChatFormat


class AnthropicFormat(ChatFormat):
    id_prefix = "msg_"
    stream_end = ""  # message_stop ends the stream

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.block: str | None = None  # the type of the content block open in the stream
        self.blocks = 0  # content blocks started so far

    @staticmethod
    def sse(payload: Any) -> str:
        if isinstance(payload, list):
            return "".join(AnthropicFormat.sse(event) for event in payload)
        if "error" in payload and "type" not in payload:  # serving's error event, OpenAI-shaped
            payload = error_body(500, payload["error"]["message"])
        return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def first_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        message = self.message([], None, None, usage)
        return [{"type": "message_start", "message": message}]

    def chunks(self, moved: list[Moved]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for chunk in super().chunks(moved):
            delta = chunk.choices[0].delta
            if delta.content:
                if self.block != "text":
                    events += self._open({"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": delta.content}))
            for call in delta.tool_calls or []:  # calls come whole, once written
                block = {"type": "tool_use", "id": call.id, "name": call.function.name, "input": {}}
                events += self._open(block)
                arguments = call.function.arguments or "{}"
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def usage_chunk(self, choices: list[Choice]) -> list[dict[str, Any]]:
        reason, sequence = stop_reason(choices[0])
        usage = {"output_tokens": len(choices[0].text.token_ids)}
        return [
            *self._close(),
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage,
            },
            {"type": "message_stop"},
        ]

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        message = super().response(choices).choices[0].message
        content: list[dict[str, Any]] = [{"type": "text", "text": message.content}] if message.content else []
        for call in message.tool_calls or []:
            arguments = json.loads(call.function.arguments or "{}")
            content.append(
                {"type": "tool_use", "id": call.id, "name": call.function.name, "input": arguments}
            )
        usage = {
            "input_tokens": self.prompt_tokens,
            "output_tokens": len(choices[0].text.token_ids),
            "cache_read_input_tokens": self.cached_tokens,
            "cache_creation_input_tokens": 0,
        }
        reason = ("tool_use", None) if message.tool_calls else stop_reason(choices[0])
        return self.message(content, *reason, usage)

    def message(
        self, content: list[dict[str, Any]], reason: str | None, sequence: str | None, usage: dict[str, int]
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        }

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        events.append({"type": "content_block_start", "index": self.blocks, "content_block": block})
        self.block = block["type"]
        self.blocks += 1
        return events

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self.block is None:
            return []
        self.block = None
        return [{"type": "content_block_stop", "index": self.blocks - 1}]


def stop_reason(choice: Choice) -> tuple[str, str | None]:
    """Anthropic's stop_reason, and the stop sequence that ended the text (if one did)."""
    text = choice.text
    if choice.calls is not None and choice.calls.count and text.finish_reason == "stop":
        return "tool_use", None
    if text.finish_reason == "length":
        return "max_tokens", None
    held = text.decoded[len(text.released) :]
    sequence = next((stop for stop in text.stops if held.startswith(stop)), None)
    return ("stop_sequence", sequence) if sequence is not None else ("end_turn", None)


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
