"""What the routes of the other APIs' dialects (Anthropic's, Ollama's) share: parse a body, check the model
it names, translate it into one of OpenAI's requests, run it through serving while the client stays, and
answer in the dialect's own JSON, stream and error shapes, counted in the metrics."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from corolla.api.http import EventStreamResponse, parse, problems, until_disconnected
from corolla.api.protocol import ErrorResponse
from corolla.api.streams import EventStream
from corolla.errors import InvalidRequest

if TYPE_CHECKING:
    from corolla.api.serving import OpenAIServing

T = TypeVar("T")
FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")  # a message's leading field path
Handler = Callable[[Any], Awaitable[Any]]  # a parsed body -> what serving returned


class Dialect:
    def __init__(
        self,
        serving: OpenAIServing,
        label: str,
        error_body: Callable[[ErrorResponse], dict[str, Any]],
        names_served: Callable[[str], bool] | None = None,
    ):
        self.serving = serving
        self.label = label  # the metrics' endpoint label is `{label}_{endpoint}`
        self.error_body = error_body
        self.names_served = names_served or (lambda given: given == serving.name)

    def answer(self, endpoint: str, result: Any) -> Response:
        """The HTTP response for what serving returned: its JSON, its stream, or the dialect's error."""
        metrics = self.serving.metrics
        if isinstance(result, ErrorResponse):
            metrics.errors.labels(result.error.type).inc()
            response: Response = JSONResponse(self.error_body(result), status_code=result.status)
        elif isinstance(result, EventStream):
            response = EventStreamResponse(result)
        else:
            response = JSONResponse(result)
        metrics.requests.labels(f"{self.label}_{endpoint}", str(response.status_code)).inc()
        return response

    async def run(
        self,
        request: Request,
        endpoint: str,
        model: type[BaseModel],
        handler: Callable[[Any], Awaitable[Any]],
    ) -> Response:
        """Parse the body as `model`, check the model it names, and answer what `handler` makes of it."""
        body = await parse(request, model)
        if not isinstance(body, ErrorResponse) and not self.names_served(body.model):
            served = self.serving.name
            body = invalid(f"model: {body.model!r} does not exist; this server serves {served!r}", 404)
        if isinstance(body, ErrorResponse):
            return self.answer(endpoint, body)
        return self.answer(endpoint, await until_disconnected(request, handler(body)))


def translated(make: Callable[[], T]) -> T | ErrorResponse:
    """A request translated by `make`, or the 400 naming the field that could not be."""
    try:
        return make()
    except (InvalidRequest, ValidationError) as e:
        return invalid(problems(e))


def invalid(message: str, status: int = 400) -> ErrorResponse:
    """The error, its `param` the field its message begins with (`tools[0]: ...` names tools[0])."""
    named = FIELD.match(message)
    return ErrorResponse.make(status, message, "invalid_request_error", named[1] if named else None)
