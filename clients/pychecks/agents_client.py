"""The OpenAI Agents SDK (openai-agents) with its default model provider, which speaks the Responses API,
pointed at `corolla api` (`set_default_openai_client`; tracing off, so nothing goes to another host): an
agent that answers, and an agent that calls a Python tool and answers with its result."""

from __future__ import annotations

from importlib.metadata import version as package_version
from typing import Annotated

from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from pydantic import Field

from pychecks.common import CALL_TOKENS, WEATHER, Setup, check_answer, require

ENDED_TOKENS = 64  # the SDK takes a cut answer (response.incomplete) for an error: room to end


def version() -> str:
    return package_version("openai-agents")


def use(url: str, key: str) -> None:
    """The default provider's client: the server at `url`; no traces sent anywhere."""
    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=300), False)


def answer(setup: Setup) -> str:
    use(setup.smol_url, setup.key)
    settings = ModelSettings(temperature=0, max_tokens=ENDED_TOKENS)
    instructions = "You are a helpful assistant."  # ("Answer briefly." sends SmolLM2 into a loop)
    agent = Agent(name="Geo", instructions=instructions, model=setup.smol_model, model_settings=settings)
    result = Runner.run_sync(agent, "What is the capital of France?")
    require("Paris" in str(result.final_output), f"the answer: {result.final_output!r}")
    return check_answer(result.final_output)


def tool_call(setup: Setup) -> str:
    """The model must call the tool (tool_choice names it): the SDK parses the call, runs the Python
    function, and (the model's random text never ending) takes the tool's result as the final output."""
    calls: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=24)]) -> str:
        """The current weather in a city."""
        calls.append(city)
        return WEATHER

    use(setup.tool_url, setup.key)
    settings = ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=CALL_TOKENS)
    agent = Agent(
        name="Forecaster",
        model=setup.tool_model,
        tools=[get_weather],
        model_settings=settings,
        tool_use_behavior="stop_on_first_tool",
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    kinds = [item.type for item in result.new_items]
    require(calls and kinds == ["tool_call_item", "tool_call_output_item"], f"{len(calls)} calls; {kinds}")
    require(result.final_output == WEATHER, f"the final output {result.final_output!r}")
    return f"get_weather({calls[0]!r}) ran; items {kinds}; the output {result.final_output}"


CHECKS = {"answer": answer, "tool_call": tool_call}
