"""HTTP plumbing shared by the routes: parsing a body into OpenAI's error shape, racing the client's
disconnect, and an SSE response whose event stream is always closed.

Bodies are parsed here (not by FastAPI's injection) so that every bad request, malformed JSON included,
gets OpenAI's error shape with the offending field named.
"""

from __future__ import annotations

import asyncio
import codecs
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from corolla.api.protocol import ErrorResponse
from corolla.api.streams import EventStream

MAX_BODY_BYTES = 8 << 20
Answer = Callable[[str, Any], Response]  # (endpoint, serving's result) -> the HTTP response
# (request, endpoint, body model, serving's handler) -> the response: parse, check the model, run
Generate = Callable[[Request, str, type[BaseModel], Callable[[Any], Awaitable[Any]]], Awaitable[Response]]


class EventStreamResponse(StreamingResponse):
    """A streamed answer (SSE, or JSON lines) whose event stream is always closed when the response ends,
    even if the client left."""

    def __init__(self, events: EventStream):
        super().__init__(events, media_type=events.media_type, headers={"Cache-Control": "no-cache"})
        self.events = events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()


async def parse(request: Request, model: type[BaseModel]) -> BaseModel | ErrorResponse:
    """The body as `model`, or a 400 naming the field at fault (`body` for the body as a whole).

    pydantic parses and validates in one step, and its JSON parser refuses what `json.loads` would crash
    on or accept: nesting over 200 levels, number literals over ~4300 digits, invalid UTF-8, lone
    surrogates. Every malformed body is thus a ValidationError, at the body's own location."""
    body = await read_body(request)
    if body is None:
        message = f"the body exceeds {MAX_BODY_BYTES} bytes"
        return ErrorResponse.make(413, message, "invalid_request_error", "body")
    try:
        return model.model_validate_json(body.removeprefix(codecs.BOM_UTF8))
    except ValidationError as e:
        param = _field(e.errors()[0]["loc"]) or "body"
        return ErrorResponse.make(400, problems(e), "invalid_request_error", param)


async def read_body(request: Request) -> bytes | None:
    """The request's body, or None as soon as it exceeds MAX_BODY_BYTES (the rest is never read)."""
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def problems(e: ValidationError | Exception) -> str:
    """What is wrong with a request, naming the fields (at most 5): a translated request's errors (the
    Ollama and Anthropic routes), in the words of `parse`'s."""
    if not isinstance(e, ValidationError):
        return str(e)
    found = dict.fromkeys(f"{_field(err['loc']) or 'body'}: {err['msg']}" for err in e.errors())
    return "; ".join(list(found)[:5])


def _field(loc: tuple[int | str, ...]) -> str:
    """A validation error's location as the request's field path: `messages.0.content`, without the
    tags pydantic adds for each member of a union (`str`, `list[function-after[..., TextPart]]`)."""

    def is_tag(part: int | str) -> bool:
        return isinstance(part, str) and (not part.isidentifier() or part[0].isupper() or part in TYPE_TAGS)

    return ".".join(str(part) for part in loc if not is_tag(part))


async def until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`, cancelling it if the client disconnects first (then there is nobody to answer)."""
    task = asyncio.ensure_future(work)

    async def listen() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(listen())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return ErrorResponse.make(499, "the client closed the request", "client_closed")
    return task.result()
