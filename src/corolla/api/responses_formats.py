"""The Responses API's shapes for corolla's answers (api/responses.py): a response object whose output holds a
message item (`output_text`) and `function_call` items, with `usage` (cached tokens included); streamed as
the API's typed events, each with its sequence number: response.created and .in_progress, then per item
output_item.added, its content part or call arguments' deltas and .done events, output_item.done, and at
the end response.completed (response.incomplete when max_output_tokens cut the answer). Built on OpenAI's
chat format (api/formats.py), so tool calls, stop strings and finish reasons are worked out once."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from corolla.api.choices import Choice, Moved
from corolla.api.formats import ChatFormat
from corolla.api.outputs import ChatLogprobs
from corolla.api.responses_tools import split_name

Event = dict[str, Any]


@dataclass
class Turn:
    """What a response echoes of its request, and where it is kept once complete (unless store is off)."""

    echo: dict[str, Any]
    keep: Callable[[dict[str, Any]], None] = field(default=lambda response: None)
    namespaces: frozenset[str] = frozenset()  # the request's namespace tools: their calls name them


class ResponsesFormat(ChatFormat):
    id_prefix = "resp_"
    prompt_param = "input"
    limit_param = "max_output_tokens"
    stream_end = ""  # response.completed ends the stream
    turn = Turn({})

    @classmethod
    def bound(cls, turn: Turn) -> type[ResponsesFormat]:
        """This format for one request (serving makes the instance)."""
        return type(cls.__name__, (cls,), {"turn": turn})

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.created_at = int(time.time())
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items done so far
        self.message: dict[str, Any] | None = None  # the message item being streamed

    def sse(self, payload: Any) -> str:
        if isinstance(payload, list):
            return "".join(self.sse(event) for event in payload)
        if "error" in payload and "type" not in payload:  # serving's error event, OpenAI-shaped
            return self.sse(self._failed(payload["error"]))
        payload = {"type": payload["type"], **payload, "sequence_number": self.sequence}  # type first
        self.sequence += 1
        return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    # --- a whole answer -------------------------------------------------------------------------------------

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        chat = super().response(choices).choices[0]
        message = chat.message
        if message.content:
            part = self._part(message.content, chat.logprobs)
            self.output.append(self._message_item([part], _status(choices[0])))
        for call in message.tool_calls or []:
            self.output.append(self._call_item(call.id, call.function.name, call.function.arguments or "{}"))
        return self._finished(choices)

    # --- a stream -------------------------------------------------------------------------------------------

    def first_chunks(self, num_choices: int) -> list[Event]:
        response = self.snapshot("in_progress")
        return [
            {"type": "response.created", "response": response},
            {"type": "response.in_progress", "response": response},
        ]

    def chunks(self, moved: list[Moved]) -> list[Event]:
        events: list[Event] = []
        for chunk in super().chunks(moved):
            choice = chunk.choices[0]
            if choice.delta.content:
                events += self._text_delta(choice.delta.content, choice.logprobs)
            for call in choice.delta.tool_calls or []:  # calls come whole, once written
                events += self._close_message()
                events += self._call_events(call.id, call.function.name, call.function.arguments or "{}")
        return events

    def usage_chunk(self, choices: list[Choice]) -> list[Event]:
        events = self._close_message(_status(choices[0]))
        response = self._finished(choices)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*events, {"type": kind, "response": response}]

    def _text_delta(self, text: str, logprobs: ChatLogprobs | None) -> list[Event]:
        events: list[Event] = []
        if self.message is None:
            self.message = self._message_item([], "in_progress")
            events.append(self._added(self.message))
            part = self._part("", None)
            events.append({**self._where(self.message), "type": "response.content_part.added", "part": part})
            self.message["content"].append(part)
        part = self.message["content"][0]
        part["text"] += text
        tokens = _logprobs(logprobs)
        if tokens is not None:
            part["logprobs"] += tokens
        delta = {"type": "response.output_text.delta", "delta": text, "logprobs": tokens or []}
        return [*events, {**self._where(self.message), **delta}]

    def _close_message(self, status: str = "completed") -> list[Event]:
        item = self.message
        if item is None:
            return []
        self.message = None
        item["status"] = status
        part = item["content"][0]
        where = self._where(item)
        text = {"type": "response.output_text.done", "text": part["text"], "logprobs": part["logprobs"]}
        self.output.append(item)
        return [
            {**where, **text},
            {**where, "type": "response.content_part.done", "part": part},
            self._done(item),
        ]

    def _call_events(self, call_id: str, name: str, arguments: str) -> list[Event]:
        item = self._call_item(call_id, name, "")
        item["status"] = "in_progress"
        added = self._added(item)
        where = {"item_id": item["id"], "output_index": added["output_index"]}
        item.update(arguments=arguments, status="completed")
        self.output.append(item)
        return [
            added,
            {**where, "type": "response.function_call_arguments.delta", "delta": arguments},
            {
                **where,
                "type": "response.function_call_arguments.done",
                "arguments": arguments,
                "name": item["name"],
            },
            self._done(item),
        ]

    def _added(self, item: dict[str, Any]) -> Event:
        index = len(self.output)
        snapshot = json.loads(json.dumps(item))  # as it is now: the item changes as it streams
        return {"type": "response.output_item.added", "output_index": index, "item": snapshot}

    def _done(self, item: dict[str, Any]) -> Event:
        return {"type": "response.output_item.done", "output_index": self.output.index(item), "item": item}

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        index = self.output.index(item) if item in self.output else len(self.output)
        return {"item_id": item["id"], "output_index": index, "content_index": 0}

    def _failed(self, error: dict[str, Any]) -> list[Event]:
        failed = self.snapshot("failed")
        failed["error"] = {"code": error.get("code") or "server_error", "message": error["message"]}
        error_event = {"type": "error", "code": error.get("code"), "message": error["message"]}
        return [{**error_event, "param": error.get("param")}, {"type": "response.failed", "response": failed}]

    # --- the response object --------------------------------------------------------------------------------

    def snapshot(self, status: str) -> dict[str, Any]:
        """The response object as it stands (OpenAI's fields, the request's settings echoed)."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": list(self.output),
            "usage": None,
            **self.turn.echo,
        }

    def _finished(self, choices: list[Choice]) -> dict[str, Any]:
        status = _status(choices[0])
        response = self.snapshot(status)
        response["completed_at"] = int(time.time())
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        output_tokens = len(choices[0].text.token_ids)
        response["usage"] = {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + output_tokens,
        }
        self.turn.keep(response)
        return response

    def _message_item(self, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
        item_id = f"msg_{uuid.uuid4().hex}"
        return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def _part(self, text: str, logprobs: ChatLogprobs | None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": _logprobs(logprobs) or []}

    def _call_item(self, call_id: str, name: str, arguments: str) -> dict[str, Any]:
        """A function call item; a namespace's function is named as the request named it, with its
        `namespace` (the model saw one qualified name)."""
        namespace, function = split_name(name, self.turn.namespaces)
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed"}
        item.update(call_id=call_id, name=function, arguments=arguments)
        return item if namespace is None else {**item, "namespace": namespace}


def _status(choice: Choice) -> str:
    return "incomplete" if choice.text.finish_reason == "length" else "completed"


def _logprobs(logprobs: ChatLogprobs | None) -> list[dict[str, Any]] | None:
    """Chat's token logprobs in the Responses API's shape (the same fields)."""
    if logprobs is None:
        return None
    return [token.model_dump() for token in logprobs.content or []]
