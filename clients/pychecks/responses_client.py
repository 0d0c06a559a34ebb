"""The official openai Python SDK's Responses calls (`client.responses`) against `corolla api`'s
`/v1/responses`: plain and streamed (the SDK's typed event parser), a function call round trip continued
with previous_response_id, structured output (`responses.parse`), and a conversation continued, read back
and deleted."""

from __future__ import annotations

import json
from importlib.metadata import version as package_version
from typing import Any

import openai
from openai import OpenAI

from pychecks.common import (
    ANSWER_TOKENS,
    ASK_CAPITAL,
    ASK_FORECAST,
    ASK_WEATHER,
    CALL_TOKENS,
    JSON_TOKENS,
    SAY_HELLO,
    WEATHER,
    WEATHER_TOOL,
    Capital,
    Forecast,
    Setup,
    check_answer,
    expect_error,
    require,
)

TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's flat function tool
FORCE = {"type": "function", "name": TOOL["name"]}
ENDED_TOKENS = 64  # SmolLM2's greetings and one-line answers end well within this


def version() -> str:
    return package_version("openai")


def client(url: str, key: str) -> OpenAI:
    return OpenAI(base_url=url, api_key=key, max_retries=0, timeout=300)


def plain_and_stream(setup: Setup) -> str:
    """A plain answer, and the same request streamed: the typed events assemble into the same text (room
    to end: the SDK's stream wants response.completed, and a cut answer ends with response.incomplete)."""
    smol = client(setup.smol_url, setup.key)
    ask = dict(model=setup.smol_model, input=SAY_HELLO, max_output_tokens=ENDED_TOKENS, temperature=0)
    plain = smol.responses.create(**ask)
    require(plain.status == "completed", f"status {plain.status!r}")
    with smol.responses.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    ends = ("response.completed", "response.incomplete")
    require(kinds[0] == "response.created" and kinds[-1] in ends, f"events {kinds}")
    require(streamed.output_text == plain.output_text, f"{streamed.output_text!r} vs {plain.output_text!r}")
    return f"{check_answer(plain.output_text, plain.status)}, streamed in {len(kinds)} events alike"


def call_of(response: Any) -> Any:
    calls = [item for item in response.output if item.type == "function_call"]
    require(len(calls) == 1, f"{len(calls)} function calls in {response.output}")
    call = calls[0]
    require(call.name == "get_weather", f"the call names {call.name!r}")
    require(isinstance(json.loads(call.arguments).get("city"), str), f"no string city in {call.arguments!r}")
    return call


def tool_round_trip(setup: Setup) -> str:
    """A forced call (plain and streamed alike); its output as the next turn's input with
    previous_response_id: a text answer."""
    tiny = client(setup.tool_url, setup.key)
    ask = dict(model=setup.tool_model, tools=[TOOL], temperature=0)
    forced = dict(input=ASK_WEATHER, tool_choice=FORCE, max_output_tokens=CALL_TOKENS)
    called = tiny.responses.create(**ask, **forced)
    call = call_of(called)
    with tiny.responses.stream(**ask, **forced) as stream:
        streamed = call_of(stream.get_final_response())
    require(streamed.arguments == call.arguments, f"streamed {streamed.arguments}, plain {call.arguments}")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER}
    final = tiny.responses.create(
        **ask, input=[output], previous_response_id=called.id, max_output_tokens=ANSWER_TOKENS
    )
    return f"get_weather({call.arguments}), streamed alike, then {check_answer(final.output_text)}"


def namespace_tool(setup: Setup) -> str:
    """The function in a namespace (as Codex groups its sub-agent tools), forced: the call comes back named
    as sent, with its namespace (the SDK's `namespace`); its output continues the conversation."""
    tiny = client(setup.tool_url, setup.key)
    group = {"type": "namespace", "name": "weather", "description": "Weather tools.", "tools": [TOOL]}
    ask = dict(model=setup.tool_model, tools=[group], temperature=0)
    force = {**FORCE, "namespace": "weather"}
    called = tiny.responses.create(**ask, input=ASK_WEATHER, tool_choice=force, max_output_tokens=CALL_TOKENS)
    call = call_of(called)
    require(call.namespace == "weather", f"the call's namespace is {call.namespace!r}")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER}
    final = tiny.responses.create(
        **ask, input=[output], previous_response_id=called.id, max_output_tokens=ANSWER_TOKENS
    )
    return f"weather.get_weather({call.arguments}), then {check_answer(final.output_text)}"


def structured(url: str, model: str, key: str, schema: type, messages: list) -> str:
    parsed = client(url, key).responses.parse(
        model=model, input=messages, text_format=schema, max_output_tokens=JSON_TOKENS, temperature=0
    )
    require(isinstance(parsed.output_parsed, schema), f"parsed {parsed.output_parsed!r}")
    return f"{schema.__name__} {parsed.output_parsed.model_dump()}"


def conversation(setup: Setup) -> str:
    """A second turn sends only its question: the first turn's tokens are reused; the response is read
    back, and gone once deleted."""
    smol = client(setup.smol_url, setup.key)
    ask = dict(model=setup.smol_model, max_output_tokens=ANSWER_TOKENS, temperature=0)
    first = smol.responses.create(**ask, input="What is the capital of France?")
    second = smol.responses.create(**ask, input="And of Germany?", previous_response_id=first.id)
    cached = second.usage.input_tokens_details.cached_tokens
    require(cached > 0, f"no prompt tokens reused: {second.usage}")
    require(smol.responses.retrieve(second.id).output_text == second.output_text, "retrieved differs")
    smol.responses.delete(second.id)
    expect_error(openai.NotFoundError, lambda: smol.responses.retrieve(second.id))
    return f"{check_answer(second.output_text)} with {cached}/{second.usage.input_tokens} tokens reused"


def tools_unsupported(setup: Setup) -> str:
    smol = client(setup.smol_url, setup.key)
    call = lambda: smol.responses.create(model=setup.smol_model, input=ASK_WEATHER, tools=[TOOL])  # noqa: E731
    error = expect_error(openai.BadRequestError, call)
    require("tools" in error.body["message"], f"the error: {error.body}")
    return f"400: {error.body['message'][:120]}"


CHECKS = {
    "plain_and_stream": plain_and_stream,
    "tool_round_trip": tool_round_trip,
    "namespace_tool": namespace_tool,
    "conversation": conversation,
    "tools_unsupported_400": tools_unsupported,
    "structured_tiny": lambda s: structured(s.tool_url, s.tool_model, s.key, Forecast, ASK_FORECAST),
    "structured_smollm2": lambda s: structured(s.smol_url, s.smol_model, s.key, Capital, ASK_CAPITAL),
}
