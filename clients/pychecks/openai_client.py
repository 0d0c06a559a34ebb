"""The official `openai` Python client, called the way its documentation shows."""

from __future__ import annotations

import json
from typing import Any

import openai
from openai import OpenAI

from pychecks.common import (
    ANSWER_TOKENS,
    ASK_CAPITAL,
    ASK_FORECAST,
    ASK_WEATHER,
    CALL_TOKENS,
    FORCE_WEATHER,
    JSON_TOKENS,
    SAY_HELLO,
    TEXTS,
    WEATHER,
    WEATHER_TOOL,
    Capital,
    Forecast,
    Setup,
    check_answer,
    check_same,
    check_tool_call,
    check_vectors,
    embeddings_detail,
    expect_error,
    require,
)


def version() -> str:
    return openai.__version__


def client(url: str, key: str) -> OpenAI:
    return OpenAI(base_url=url, api_key=key, max_retries=0, timeout=300)


def auth(setup: Setup) -> str:
    """A 401 without the key and with a wrong one; an answer with the key. This client refuses to send a
    request with no key at all (OpenAIError: Missing credentials), so `without` omits the header."""
    without = {"extra_headers": {"Authorization": openai.omit}}
    for key, extra in ((setup.key, without), (f"not-{setup.key}", {})):
        smol = client(setup.smol_url, key)
        error = expect_error(
            openai.AuthenticationError,
            lambda smol=smol, extra=extra: smol.chat.completions.create(
                model=setup.smol_model, messages=SAY_HELLO, max_tokens=ANSWER_TOKENS, **extra
            ),
        )
        require(error.status_code == 401, f"status {error.status_code}, not 401")
    answer = client(setup.smol_url, setup.key).chat.completions.create(
        model=setup.smol_model, messages=SAY_HELLO, max_tokens=ANSWER_TOKENS, temperature=0
    )
    choice = answer.choices[0]
    require(choice.message.content, f"an empty answer with the key: {choice}")
    return f"401 without a key and with a wrong one; with it: {choice.message.content!r}"


def ask_weather(tiny: OpenAI, setup: Setup, **extra: Any) -> Any:
    return tiny.chat.completions.create(
        model=setup.tool_model,
        messages=ASK_WEATHER,
        tools=[WEATHER_TOOL],
        tool_choice=FORCE_WEATHER,
        max_tokens=CALL_TOKENS,
        temperature=0,
        **extra,
    )


def tool_round_trip(setup: Setup) -> str:
    tiny = client(setup.tool_url, setup.key)
    choice = ask_weather(tiny, setup).choices[0]
    require(choice.message.tool_calls, f"no tool_calls in the answer: {choice}")
    call = choice.message.tool_calls[0]
    shown = check_tool_call(
        call.function.name, call.function.arguments, choice.finish_reason, choice.message.content
    )
    result = {"role": "tool", "tool_call_id": call.id, "content": WEATHER}
    final = tiny.chat.completions.create(
        model=setup.tool_model,
        messages=[*ASK_WEATHER, choice.message, result],  # the answer's message as it came, as documented
        tools=[WEATHER_TOOL],
        max_tokens=ANSWER_TOKENS,
        temperature=0,
    )
    return f"{shown}, then {check_answer(final.choices[0].message.content, final.choices[0].finish_reason)}"


def assemble(stream: Any) -> tuple[list[dict], str, str | None]:
    """A stream's tool calls (from their deltas, by index), its text and its finish reason."""
    calls: dict[int, dict] = {}
    text, finish_reason = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return [calls[index] for index in sorted(calls)], text, finish_reason


def tool_round_trip_stream(setup: Setup) -> str:
    """The streamed call is the one a plain request gets (greedy); then the answer to its result, streamed."""
    tiny = client(setup.tool_url, setup.key)
    plain = ask_weather(tiny, setup).choices[0].message.tool_calls
    calls, text, finish_reason = assemble(ask_weather(tiny, setup, stream=True))
    require(len(calls) == 1, f"{len(calls)} tool calls in the stream: {calls}")
    call = calls[0]
    shown = check_tool_call(call["name"], call["arguments"], finish_reason, text)
    require(call["id"], f"the streamed call has no id: {call}")
    if plain:
        same = (call["name"], json.loads(call["arguments"])) == (
            plain[0].function.name,
            json.loads(plain[0].function.arguments),
        )
        require(same, f"the streamed call {call} is not the plain request's {plain[0].function}")
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call["id"], "type": "function", "function": {k: call[k] for k in ("name", "arguments")}}
        ],
    }
    result = {"role": "tool", "tool_call_id": call["id"], "content": WEATHER}
    stream = tiny.chat.completions.create(
        model=setup.tool_model,
        messages=[*ASK_WEATHER, assistant, result],
        tools=[WEATHER_TOOL],
        max_tokens=ANSWER_TOKENS,
        temperature=0,
        stream=True,
    )
    _, text, finish_reason = assemble(stream)
    return f"streamed {shown}, then {check_answer(text, finish_reason)}"


def tools_unsupported(setup: Setup) -> str:
    """SmolLM2's chat template renders no tools: a 400 that says so."""
    smol = client(setup.smol_url, setup.key)
    error = expect_error(
        openai.BadRequestError,
        lambda: smol.chat.completions.create(
            model=setup.smol_model, messages=ASK_WEATHER, tools=[WEATHER_TOOL], max_tokens=ANSWER_TOKENS
        ),
    )
    message = str(error.message).lower()
    require(
        "tool" in message and "template" in message, f"the 400 does not name tools and the template: {error}"
    )
    return f"400: {error.message}"


def structured(url: str, model: str, schema: type, messages: list, key: str) -> str:
    answer = client(url, key).chat.completions.parse(
        model=model, messages=messages, response_format=schema, max_tokens=JSON_TOKENS, temperature=0
    )
    message = answer.choices[0].message
    require(isinstance(message.parsed, schema), f"no parsed {schema.__name__}: content {message.content!r}")
    return repr(message.parsed)


def structured_tiny(setup: Setup) -> str:
    return structured(setup.tool_url, setup.tool_model, Forecast, ASK_FORECAST, setup.key)


def structured_smol(setup: Setup) -> str:
    return structured(setup.smol_url, setup.smol_model, Capital, ASK_CAPITAL, setup.key)


def embeddings(setup: Setup) -> str:
    """The client asks for base64 unless told otherwise; float must give the same vectors."""
    smol = client(setup.smol_url, setup.key)

    def embed(**extra: Any) -> list[list[float]]:
        data = smol.embeddings.create(model=setup.smol_model, input=TEXTS, **extra).data
        return [item.embedding for item in sorted(data, key=lambda item: item.index)]

    first = embed()
    check_vectors(first)
    check_same(first, embed(), "a second call")
    check_same(first, embed(encoding_format="float"), "encoding_format=float")
    return embeddings_detail(first, "a second call and with encoding_format=float")


CHECKS = {
    "auth": auth,
    "tool_round_trip": tool_round_trip,
    "tool_round_trip_stream": tool_round_trip_stream,
    "tools_unsupported_400": tools_unsupported,
    "structured_tiny": structured_tiny,
    "structured_smollm2": structured_smol,
    "embeddings": embeddings,
}
