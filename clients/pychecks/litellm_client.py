"""litellm, with corolla as an OpenAI-compatible provider: `openai/<served name>` and `api_base`."""

from __future__ import annotations

from importlib.metadata import version as package_version
from typing import Any

import litellm

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

litellm.suppress_debug_info = True  # no "Give Feedback / Get Help" banner on every error


def version() -> str:
    return package_version("litellm")


def provider(url: str, model: str, key: str) -> dict[str, Any]:
    return {"model": f"openai/{model}", "api_base": url, "api_key": key, "num_retries": 0, "timeout": 300}


def auth(setup: Setup) -> str:
    error = expect_error(
        litellm.AuthenticationError,
        lambda: litellm.completion(
            **provider(setup.smol_url, setup.smol_model, f"not-{setup.key}"),
            messages=SAY_HELLO,
            max_tokens=ANSWER_TOKENS,
        ),
    )
    require(error.status_code == 401, f"status {error.status_code}, not 401")
    answer = litellm.completion(
        **provider(setup.smol_url, setup.smol_model, setup.key),
        messages=SAY_HELLO,
        max_tokens=ANSWER_TOKENS,
        temperature=0,
    )
    content = answer.choices[0].message.content
    require(content, f"an empty answer with the key: {answer}")
    return f"AuthenticationError (401) with a wrong key; with the key: {content!r}"


def tool_round_trip(setup: Setup) -> str:
    tiny = provider(setup.tool_url, setup.tool_model, setup.key)
    common = {"tools": [WEATHER_TOOL], "temperature": 0}
    response = litellm.completion(
        **tiny, **common, messages=ASK_WEATHER, tool_choice=FORCE_WEATHER, max_tokens=CALL_TOKENS
    )
    choice = response.choices[0]
    require(choice.message.tool_calls, f"no tool_calls in the answer: {choice}")
    call = choice.message.tool_calls[0]
    shown = check_tool_call(
        call.function.name, call.function.arguments, choice.finish_reason, choice.message.content
    )
    # as litellm's function-calling guide does it: the response's message, then the tool's result
    result = {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": WEATHER}
    final = litellm.completion(
        **tiny, **common, messages=[*ASK_WEATHER, choice.message, result], max_tokens=ANSWER_TOKENS
    )
    return f"{shown}, then {check_answer(final.choices[0].message.content, final.choices[0].finish_reason)}"


def tools_unsupported(setup: Setup) -> str:
    error = expect_error(
        litellm.BadRequestError,
        lambda: litellm.completion(
            **provider(setup.smol_url, setup.smol_model, setup.key),
            messages=ASK_WEATHER,
            tools=[WEATHER_TOOL],
            max_tokens=ANSWER_TOKENS,
        ),
    )
    message = str(error.message).lower()
    require(
        "tool" in message and "template" in message, f"the 400 does not name tools and the template: {error}"
    )
    return f"400: {error.message}"


def structured(url: str, model: str, schema: type, messages: list, key: str) -> str:
    answer = litellm.completion(
        **provider(url, model, key),
        messages=messages,
        response_format=schema,
        max_tokens=JSON_TOKENS,
        temperature=0,
    )
    content = answer.choices[0].message.content
    return repr(schema.model_validate_json(content))


def structured_tiny(setup: Setup) -> str:
    return structured(setup.tool_url, setup.tool_model, Forecast, ASK_FORECAST, setup.key)


def structured_smol(setup: Setup) -> str:
    return structured(setup.smol_url, setup.smol_model, Capital, ASK_CAPITAL, setup.key)


def embeddings(setup: Setup) -> str:
    def embed() -> list[list[float]]:
        response = litellm.embedding(**provider(setup.smol_url, setup.smol_model, setup.key), input=TEXTS)
        return [item["embedding"] for item in sorted(response.data, key=lambda item: item["index"])]

    first = embed()
    check_vectors(first)
    check_same(first, embed(), "a second call")
    return embeddings_detail(first, "a second call")


CHECKS = {
    "auth": auth,
    "tool_round_trip": tool_round_trip,
    "tools_unsupported_400": tools_unsupported,
    "structured_tiny": structured_tiny,
    "structured_smollm2": structured_smol,
    "embeddings": embeddings,
}
