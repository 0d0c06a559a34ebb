"""LangChain's OpenAI integration (langchain-openai): ChatOpenAI and OpenAIEmbeddings with a base_url."""

from __future__ import annotations

from importlib.metadata import version as package_version

import openai
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI, OpenAIEmbeddings

from pychecks.common import (
    ANSWER_TOKENS,
    ASK_CAPITAL,
    ASK_FORECAST,
    ASK_WEATHER,
    CALL_TOKENS,
    JSON_TOKENS,
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
    return ", ".join(f"{name} {package_version(name)}" for name in ("langchain-openai", "langchain-core"))


def chat(url: str, model: str, key: str, max_tokens: int) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=url,
        api_key=key,
        model=model,
        temperature=0,
        max_tokens=max_tokens,
        max_retries=0,
        timeout=300,
    )


def auth(setup: Setup) -> str:
    wrong = chat(setup.smol_url, setup.smol_model, f"not-{setup.key}", ANSWER_TOKENS)
    error = expect_error(openai.AuthenticationError, lambda: wrong.invoke("Say hello."))
    require(error.status_code == 401, f"status {error.status_code}, not 401")
    answer = chat(setup.smol_url, setup.smol_model, setup.key, ANSWER_TOKENS).invoke("Say hello.")
    require(isinstance(answer.content, str) and answer.content, f"an empty answer with the key: {answer}")
    return f"AuthenticationError (401) with a wrong key; with the key: {answer.content!r}"


def tool_round_trip(setup: Setup) -> str:
    """bind_tools with tool_choice naming the tool; the AIMessage and a ToolMessage back."""
    question = HumanMessage(ASK_WEATHER[0]["content"])
    caller = chat(setup.tool_url, setup.tool_model, setup.key, CALL_TOKENS)
    message = caller.bind_tools([WEATHER_TOOL], tool_choice="get_weather").invoke([question])
    require(message.tool_calls, f"no tool_calls in the answer: {message!r}")
    call = message.tool_calls[0]
    finish_reason = message.response_metadata.get("finish_reason")
    shown = check_tool_call(call["name"], call["args"], finish_reason, message.content)
    answerer = chat(setup.tool_url, setup.tool_model, setup.key, ANSWER_TOKENS).bind_tools([WEATHER_TOOL])
    final = answerer.invoke([question, message, ToolMessage(WEATHER, tool_call_id=call["id"])])
    return f"{shown}, then {check_answer(final.content, final.response_metadata.get('finish_reason'))}"


def tools_unsupported(setup: Setup) -> str:
    smol = chat(setup.smol_url, setup.smol_model, setup.key, ANSWER_TOKENS).bind_tools([WEATHER_TOOL])
    error = expect_error(openai.BadRequestError, lambda: smol.invoke(ASK_WEATHER[0]["content"]))
    message = str(error.message).lower()
    require(
        "tool" in message and "template" in message, f"the 400 does not name tools and the template: {error}"
    )
    return f"400: {error.message}"


def structured(url: str, model: str, schema: type, messages: list, key: str) -> str:
    runnable = chat(url, model, key, JSON_TOKENS).with_structured_output(schema, method="json_schema")
    parsed = runnable.invoke(messages[0]["content"])
    require(isinstance(parsed, schema), f"not a {schema.__name__}: {parsed!r}")
    return repr(parsed)


def structured_tiny(setup: Setup) -> str:
    return structured(setup.tool_url, setup.tool_model, Forecast, ASK_FORECAST, setup.key)


def structured_smol(setup: Setup) -> str:
    return structured(setup.smol_url, setup.smol_model, Capital, ASK_CAPITAL, setup.key)


def embeddings(setup: Setup) -> str:
    """check_embedding_ctx_length=False: the texts go as text, not as tiktoken's token ids."""
    model = OpenAIEmbeddings(
        model=setup.smol_model,
        base_url=setup.smol_url,
        api_key=setup.key,
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    first = model.embed_documents(TEXTS)
    check_vectors(first)
    check_same(first, model.embed_documents(TEXTS), "a second call")
    check_same(first, [model.embed_query(TEXTS[0]), model.embed_query(TEXTS[1])], "embed_query")
    return embeddings_detail(first, "a second call and through embed_query")


CHECKS = {
    "auth": auth,
    "tool_round_trip": tool_round_trip,
    "tools_unsupported_400": tools_unsupported,
    "structured_tiny": structured_tiny,
    "structured_smollm2": structured_smol,
    "embeddings": embeddings,
}
