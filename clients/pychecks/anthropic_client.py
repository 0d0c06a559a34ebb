"""The official anthropic Python SDK against `corolla api`'s Messages API (`/v1/messages` at the server's
root, the key as `x-api-key`, as the SDK sends it). The SDK has no sampling arguments: greedy answers ask
for `temperature: 0` as an extra body field."""

from __future__ import annotations

import json
from importlib.metadata import version as package_version
from typing import Any

import anthropic

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

GREEDY = {"temperature": 0}
TOOL = {
    "name": WEATHER_TOOL["function"]["name"],
    "description": WEATHER_TOOL["function"]["description"],
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
FORCE = {"type": "tool", "name": TOOL["name"]}


def version() -> str:
    return package_version("anthropic")


def client(url: str, key: str) -> anthropic.Anthropic:
    """A client of the server at `url` (the OpenAI base URL, .../v1: the SDK adds /v1 itself)."""
    return anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key=key, max_retries=0, timeout=300)


def auth(setup: Setup) -> str:
    wrong = client(setup.smol_url, f"not-{setup.key}")
    call = lambda: wrong.messages.create(model=setup.smol_model, max_tokens=ANSWER_TOKENS, messages=SAY_HELLO)  # noqa: E731
    error = expect_error(anthropic.AuthenticationError, call)
    require(error.status_code == 401, f"status {error.status_code}, not 401")
    smol = client(setup.smol_url, setup.key)
    answer = smol.messages.create(
        model=setup.smol_model, max_tokens=ANSWER_TOKENS, messages=SAY_HELLO, extra_body=GREEDY
    )
    return f"401 with a wrong key; with the key: {check_answer(answer.content[0].text, answer.stop_reason)}"


def check_tool_use(message: Any) -> tuple[str, Any]:
    """A forced get_weather call: one tool_use block with a string city, stop_reason tool_use."""
    uses = [block for block in message.content if block.type == "tool_use"]
    require(len(uses) == 1, f"{len(uses)} tool_use blocks in {message.content}")
    use = uses[0]
    require(use.name == "get_weather", f"the call names {use.name!r}")
    require(isinstance(use.input.get("city"), str), f"no string city in {use.input!r}")
    require(message.stop_reason == "tool_use", f"stop_reason {message.stop_reason!r}, not tool_use")
    return f"get_weather({json.dumps(use.input, ensure_ascii=False)})", use


def tool_round_trip(setup: Setup) -> str:
    """A forced call; the call and its tool_result back: a text answer."""
    tiny = client(setup.tool_url, setup.key)
    ask = dict(model=setup.tool_model, tools=[TOOL], extra_body=GREEDY)
    message = tiny.messages.create(**ask, max_tokens=CALL_TOKENS, messages=ASK_WEATHER, tool_choice=FORCE)
    shown, use = check_tool_use(message)
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": WEATHER}]}
    turns = [*ASK_WEATHER, {"role": message.role, "content": message.content}, result]
    final = tiny.messages.create(**ask, max_tokens=ANSWER_TOKENS, messages=turns)
    texts = [block.text for block in final.content if block.type == "text"]
    return f"{shown}, then {check_answer(''.join(texts), final.stop_reason)}"


def tool_round_trip_stream(setup: Setup) -> str:
    """The streamed call (the SDK assembles its input_json_delta) is the one a plain request gets."""
    tiny = client(setup.tool_url, setup.key)
    ask = dict(
        model=setup.tool_model, tools=[TOOL], tool_choice=FORCE, max_tokens=CALL_TOKENS, extra_body=GREEDY
    )
    plain = tiny.messages.create(**ask, messages=ASK_WEATHER)
    with tiny.messages.stream(**ask, messages=ASK_WEATHER) as stream:
        streamed = stream.get_final_message()
    shown, use = check_tool_use(streamed)
    _, expected = check_tool_use(plain)
    require(use.input == expected.input, f"streamed {use.input!r}, plain {expected.input!r}")
    return f"{shown}, as the plain answer"


def tools_unsupported(setup: Setup) -> str:
    smol = client(setup.smol_url, setup.key)
    call = lambda: smol.messages.create(  # noqa: E731
        model=setup.smol_model, max_tokens=ANSWER_TOKENS, messages=ASK_WEATHER, tools=[TOOL]
    )
    error = expect_error(anthropic.BadRequestError, call)
    message = error.body["error"]["message"]
    require(error.body["type"] == "error" and "tools" in message, f"the error: {error.body}")
    return f"400: {message[:120]}"


def structured(url: str, model: str, key: str, schema: type, messages: list) -> str:
    config = {"format": {"type": "json_schema", "schema": schema.model_json_schema()}}
    answer = client(url, key).messages.create(
        model=model, max_tokens=JSON_TOKENS, messages=messages, output_config=config, extra_body=GREEDY
    )
    parsed = schema.model_validate_json(answer.content[0].text)
    return f"{type(parsed).__name__} {parsed.model_dump()}"


def count_tokens(setup: Setup) -> str:
    smol = client(setup.smol_url, setup.key)
    counted = smol.messages.count_tokens(model=setup.smol_model, messages=SAY_HELLO)
    sent = smol.messages.create(model=setup.smol_model, max_tokens=1, messages=SAY_HELLO)
    require(
        counted.input_tokens == sent.usage.input_tokens,
        f"{counted.input_tokens} vs {sent.usage.input_tokens}",
    )
    return f"{counted.input_tokens} tokens, as the message's usage says"


CHECKS = {
    "auth": auth,
    "tool_round_trip": tool_round_trip,
    "tool_round_trip_stream": tool_round_trip_stream,
    "tools_unsupported_400": tools_unsupported,
    "structured_tiny": lambda s: structured(s.tool_url, s.tool_model, s.key, Forecast, ASK_FORECAST),
    "structured_smollm2": lambda s: structured(s.smol_url, s.smol_model, s.key, Capital, ASK_CAPITAL),
    "count_tokens": count_tokens,
}
