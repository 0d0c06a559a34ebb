"""OpenAI's Responses API over the same serving as chat completions: `POST /v1/responses` (plain, or
streamed as typed events), `GET /v1/responses/{id}` and `DELETE /v1/responses/{id}`, for the openai SDK's
`responses` calls, the OpenAI Agents SDK and the coding agents built on them.

A request is translated into a chat completion (api/responses_protocol.py) and runs through the one chat
pipeline (templates, grammars, tools, prefix reuse, metrics, cancellation when the client leaves);
api/responses_formats.py writes the answer in the Responses API's shapes. A response is stored (unless
`store: false`) with its turn's items in api/conversations.py, under its API key: a later request that
names it as `previous_response_id` sends only its new input, and the conversation's earlier turns come
from the store; their tokens are the prefix the servers already hold, so the client reuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response

from corolla.api.access import presented_key
from corolla.api.conversations import Conversations, NotStored, owner_of
from corolla.api.dialects import Dialect, translated
from corolla.api.protocol import ErrorResponse
from corolla.api.responses_formats import ResponsesFormat, Turn
from corolla.api.responses_protocol import ResponsesRequest
from corolla.api.responses_tools import namespaces_of

if TYPE_CHECKING:
    from corolla.api.serving import OpenAIServing

T = TypeVar("T")


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, stored_responses: int):
        self.serving = serving
        self.conversations = Conversations(per_key=stored_responses)
        self.dialect = Dialect(
            serving, "responses", lambda e: e.model_dump(), lambda given: given in (None, serving.name)
        )

    async def create(self, body: ResponsesRequest, owner: str) -> Any:
        history = stored(lambda: self.conversations.history(owner, body.previous_response_id), 400)
        if isinstance(history, ErrorResponse):
            return history
        request = translated(lambda: body.to_openai(history, self.serving.name))
        if isinstance(request, ErrorResponse):
            return request
        turn = Turn(echo(body, self.serving.default_temperature), namespaces=namespaces_of(body.tools))
        if body.store and self.conversations.per_key:
            items = body.new_items()

            def keep(response: dict[str, Any]) -> None:
                turn_items = items + response["output"]
                self.conversations.keep(owner, body.previous_response_id, turn_items, response)

            turn.keep = keep
        return await self.serving.create_chat_completion(request, ResponsesFormat.bound(turn))

    def retrieve(self, owner: str, response_id: str) -> Any:
        return stored(lambda: self.conversations.get(owner, response_id).response)

    def delete(self, owner: str, response_id: str) -> Any:
        deleted = stored(lambda: self.conversations.delete(owner, response_id))
        if isinstance(deleted, ErrorResponse):
            return deleted
        return {"id": response_id, "object": "response", "deleted": True}


def echo(body: ResponsesRequest, temperature: float | None) -> dict[str, Any]:
    """The request's settings as a response repeats them (the defaults where left out)."""
    text_format = body.text.format if body.text is not None else None
    choice = body.tool_choice
    tool_choice = choice.model_dump(exclude_none=True) if hasattr(choice, "model_dump") else choice
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": body.store,
        "temperature": next(t for t in (body.temperature, temperature, 1.0) if t is not None),
        "text": {"format": text_format.model_dump(by_alias=True) if text_format else {"type": "text"}},
        "tool_choice": tool_choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "user": body.user,
    }


def stored(read: Callable[[], T], status: int = 404) -> T | ErrorResponse:
    """What `read` finds in the store, or the error naming the response id it lacks (a 404 for a route's
    path; a 400 for a request's previous_response_id, as OpenAI answers)."""
    try:
        return read()
    except NotStored as e:
        return ErrorResponse.make(status, str(e), "invalid_request_error", e.field, code="response_not_found")


def install_routes(app: FastAPI, serving: OpenAIServing, stored_responses: int) -> None:
    responses = ResponsesServing(serving, stored_responses)
    answer = responses.dialect.answer

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        owner = owner_of(presented_key(request))
        return await responses.dialect.run(
            request, "responses", ResponsesRequest, lambda body: responses.create(body, owner)
        )

    @app.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> Response:
        return answer("responses_retrieve", responses.retrieve(owner_of(presented_key(request)), response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> Response:
        return answer("responses_delete", responses.delete(owner_of(presented_key(request)), response_id))
