"""LangChain's Anthropic and Ollama integrations (langchain-anthropic's ChatAnthropic, langchain-ollama's
ChatOllama) against `corolla api`'s Messages API and Ollama's API: answers, streams, a forced tool call
and its result back (ChatAnthropic: Ollama's API has no tool_choice to force a random model's call), and
structured output."""

from __future__ import annotations

from importlib.metadata import version as package_version

from langchain_anthropic import ChatAnthropic
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_ollama import ChatOllama

from pychecks.common import (
    ANSWER_TOKENS,
    ASK_CAPITAL,
    ASK_FORECAST,
    ASK_WEATHER,
    CALL_TOKENS,
    JSON_TOKENS,
    WEATHER,
    WEATHER_TOOL,
    Capital,
    Forecast,
    Setup,
    check_answer,
    require,
)

NAMES = ("langchain-anthropic", "langchain-ollama", "langchain-core")


def version() -> str:
    return ", ".join(f"{name} {package_version(name)}" for name in NAMES)


def claude(url: str, model: str, key: str, max_tokens: int) -> ChatAnthropic:
    root = url.removesuffix("/v1")  # the anthropic SDK adds /v1 itself
    limits = {"max_tokens": max_tokens, "max_retries": 0, "timeout": 300}
    return ChatAnthropic(base_url=root, api_key=key, model=model, temperature=0, **limits)


def llama(url: str, model: str, key: str, max_tokens: int) -> ChatOllama:
    headers = {"Authorization": f"Bearer {key}"}
    root = url.removesuffix("/v1")
    return ChatOllama(
        base_url=root, model=model, temperature=0, num_predict=max_tokens, client_kwargs={"headers": headers}
    )


def answer_and_stream(model: ChatAnthropic | ChatOllama, reason_key: str) -> str:
    """`invoke` and `stream` give the same greedy text; `reason_key`: the metadata naming why it ended."""
    answer = model.invoke(ASK_WEATHER[0]["content"])
    streamed = "".join(str(chunk.content) for chunk in model.stream(ASK_WEATHER[0]["content"]))
    require(streamed == answer.content, f"streamed {streamed!r}, invoked {answer.content!r}")
    return f"{check_answer(answer.content, answer.response_metadata.get(reason_key))}, streamed alike"


def anthropic_tool_round_trip(setup: Setup) -> str:
    """bind_tools with tool_choice naming the tool; the AIMessage and a ToolMessage back."""
    question = HumanMessage(ASK_WEATHER[0]["content"])
    caller = claude(setup.tool_url, setup.tool_model, setup.key, CALL_TOKENS)
    message = caller.bind_tools([WEATHER_TOOL], tool_choice="get_weather").invoke([question])
    require(len(message.tool_calls) == 1, f"tool_calls {message.tool_calls!r}")
    call = message.tool_calls[0]
    require(call["name"] == "get_weather" and isinstance(call["args"].get("city"), str), f"the call {call}")
    answerer = claude(setup.tool_url, setup.tool_model, setup.key, ANSWER_TOKENS).bind_tools([WEATHER_TOOL])
    final = answerer.invoke([question, message, ToolMessage(WEATHER, tool_call_id=call["id"])])
    return f"get_weather({call['args']}), then {check_answer(final.text)}"


def structured(model: ChatAnthropic | ChatOllama, schema: type, messages: list) -> str:
    method = "json_schema"
    parsed = model.with_structured_output(schema, method=method).invoke(messages[0]["content"])
    require(isinstance(parsed, schema), f"not a {schema.__name__}: {parsed!r}")
    return repr(parsed)


CHECKS = {
    "anthropic_answer_stream": lambda s: answer_and_stream(
        claude(s.smol_url, s.smol_model, s.key, ANSWER_TOKENS), "stop_reason"
    ),
    "anthropic_tool_round_trip": anthropic_tool_round_trip,
    "anthropic_structured_tiny": lambda s: structured(
        claude(s.tool_url, s.tool_model, s.key, JSON_TOKENS), Forecast, ASK_FORECAST
    ),
    "anthropic_structured_smollm2": lambda s: structured(
        claude(s.smol_url, s.smol_model, s.key, JSON_TOKENS), Capital, ASK_CAPITAL
    ),
    "ollama_answer_stream": lambda s: answer_and_stream(
        llama(s.smol_url, s.smol_model, s.key, ANSWER_TOKENS), "done_reason"
    ),
    "ollama_structured_tiny": lambda s: structured(
        llama(s.tool_url, s.tool_model, s.key, JSON_TOKENS), Forecast, ASK_FORECAST
    ),
    "ollama_structured_smollm2": lambda s: structured(
        llama(s.smol_url, s.smol_model, s.key, JSON_TOKENS), Capital, ASK_CAPITAL
    ),
}
