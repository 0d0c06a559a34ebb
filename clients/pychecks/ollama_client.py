"""The official ollama Python client against `corolla api`'s Ollama routes (`/api/...` at the server's root,
the key as a bearer header)."""

from __future__ import annotations

from importlib.metadata import version as package_version

import ollama

from pychecks.common import (
    ANSWER_TOKENS,
    ASK_CAPITAL,
    ASK_FORECAST,
    ASK_WEATHER,
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

GREEDY = {"temperature": 0, "num_predict": ANSWER_TOKENS}


def version() -> str:
    return package_version("ollama")


def client(url: str, key: str) -> ollama.Client:
    """A client of the server at `url` (the OpenAI base URL, .../v1: Ollama's routes are at its root)."""
    return ollama.Client(
        host=url.removesuffix("/v1"), headers={"Authorization": f"Bearer {key}"}, timeout=300
    )


def auth(setup: Setup) -> str:
    wrong = client(setup.smol_url, f"not-{setup.key}")
    error = expect_error(ollama.ResponseError, lambda: wrong.chat(model=setup.smol_model, messages=SAY_HELLO))
    require(error.status_code == 401, f"status {error.status_code}, not 401")
    answer = client(setup.smol_url, setup.key).chat(
        model=setup.smol_model, messages=SAY_HELLO, options=GREEDY
    )
    return f"401 with a wrong key; with the key: {check_answer(answer.message.content, answer.done_reason)}"


def chat_stream(setup: Setup) -> str:
    """Streamed JSON lines assemble into the answer a plain request gets (greedy), the last line done."""
    smol = client(setup.smol_url, setup.key)
    plain = smol.chat(model=setup.smol_model, messages=SAY_HELLO, options=GREEDY)
    parts = list(smol.chat(model=setup.smol_model, messages=SAY_HELLO, options=GREEDY, stream=True))
    text = "".join(part.message.content for part in parts)
    require(text == plain.message.content, f"streamed {text!r}, plain {plain.message.content!r}")
    last = parts[-1]
    require(last.done and last.eval_count == plain.eval_count, f"the last line: {last}")
    return f"{len(parts)} lines, {last.eval_count} tokens, {check_answer(text, last.done_reason)}"


def generate(setup: Setup) -> str:
    answer = client(setup.smol_url, setup.key).generate(
        model=setup.smol_model, prompt="Say hello.", options=GREEDY
    )
    require(answer.done and answer.eval_count, f"not done, or no tokens counted: {answer}")
    return check_answer(answer.response, answer.done_reason)


def tool_result_round_trip(setup: Setup) -> str:
    """An assistant turn's tool call (arguments as an object) and the tool's result (named by tool_name)
    go back to a tool-capable model, which answers."""
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        *ASK_WEATHER,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_name": "get_weather", "content": WEATHER},
    ]
    tiny = client(setup.tool_url, setup.key)
    answer = tiny.chat(model=setup.tool_model, messages=messages, tools=[WEATHER_TOOL], options=GREEDY)
    return check_answer(answer.message.content, answer.done_reason)


def tools_unsupported(setup: Setup) -> str:
    smol = client(setup.smol_url, setup.key)
    error = expect_error(
        ollama.ResponseError,
        lambda: smol.chat(model=setup.smol_model, messages=ASK_WEATHER, tools=[WEATHER_TOOL]),
    )
    require(error.status_code == 400 and "tools" in error.error, f"{error.status_code}: {error.error}")
    return f"400: {error.error[:120]}"


def structured(url: str, model: str, key: str, schema: type, messages: list) -> str:
    options = {"temperature": 0, "num_predict": JSON_TOKENS}
    answer = client(url, key).chat(
        model=model, messages=messages, format=schema.model_json_schema(), options=options
    )
    parsed = schema.model_validate_json(answer.message.content)
    return f"{type(parsed).__name__} {parsed.model_dump()}"


CHECKS = {
    "auth": auth,
    "chat_stream": chat_stream,
    "generate": generate,
    "tool_result_round_trip": tool_result_round_trip,
    "tools_unsupported_400": tools_unsupported,
    "structured_tiny": lambda s: structured(s.tool_url, s.tool_model, s.key, Forecast, ASK_FORECAST),
    "structured_smollm2": lambda s: structured(s.smol_url, s.smol_model, s.key, Capital, ASK_CAPITAL),
}
