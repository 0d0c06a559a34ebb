"""Tools and structured output through `corolla api` on real swarms, with the official openai client.

The tool model is a tiny random Qwen2 whose chat template renders tools (tests/tool_model.py): its text
is noise, so every call and every JSON answer here exists only because constrained decoding made it.
SmolLM2's template has no tool support: tools get a 400 there, and its JSON answers are real text.
"""

from __future__ import annotations

import json

import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from corolla.launch.local import LocalSwarm
from tool_model import save_tool_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CALL_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


class City(BaseModel):
    name: str = Field(max_length=20)
    population: int = Field(ge=0, le=10**9)


@pytest.fixture(scope="module")
def tool_process(tmp_path_factory):
    """`corolla api` over a one-server swarm of the tool model."""
    path = save_tool_model(tmp_path_factory.mktemp("tool") / "tiny-qwen2-tools")
    with LocalSwarm(str(path), [(0, 6)]) as swarm:
        yield swarm.add_api(extra_args=["--served-model-name", "tiny-tools"])


@pytest.fixture(scope="module")
def tool_api(tool_process):
    return OpenAI(base_url=f"{tool_process.url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client: OpenAI, messages: list, **fields):
    fields = {"max_tokens": 100, **fields}  # a call takes about 70 tokens of this byte-level tokenizer
    return client.chat.completions.create(model="tiny-tools", messages=messages, **fields)


def test_a_tool_call_round_trip(tool_api):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    answer = ask(
        tool_api,
        messages,
        tools=[WEATHER],
        tool_choice=CALL_WEATHER,
        temperature=0,
        parallel_tool_calls=False,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(
        json.loads(call.function.arguments)["city"], str
    )
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    final = ask(tool_api, messages, tools=[WEATHER], tool_choice="none", max_tokens=5)
    assert isinstance(final.choices[0].message.content, str) and final.choices[0].message.tool_calls is None
    # the round trip resends the tools and the question: the servers still held them (reused prefixes)
    cached = final.usage.prompt_tokens_details.cached_tokens
    assert answer.usage.prompt_tokens // 2 < cached < final.usage.prompt_tokens
    # streamed, the deltas assemble into the same call (greedy: the same arguments)
    chunks = list(
        ask(
            tool_api,
            messages[:1],
            tools=[WEATHER],
            tool_choice=CALL_WEATHER,
            temperature=0,
            stream=True,
            parallel_tool_calls=False,
        )
    )
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "get_weather", call.function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's flat tool shape


def test_a_tool_round_trip_through_the_responses_api(tool_api):
    """A forced call (plain, then streamed: the same call), its output sent back as the next turn's only
    input with previous_response_id: a text answer, no call."""
    ask = {"model": "tiny-tools", "tools": [RESPONSES_WEATHER], "temperature": 0, "max_output_tokens": 100}
    forced = {"type": "function", "name": "get_weather"}
    called = tool_api.responses.create(input="Weather in Oslo?", tool_choice=forced, **ask)
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert isinstance(json.loads(call.arguments)["city"], str)
    with tool_api.responses.stream(input="Weather in Oslo?", tool_choice=forced, **ask) as stream:
        events = list(stream)
    done = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert [event.arguments for event in done] == [call.arguments]
    assert events[-1].response.output[0].name == "get_weather"

    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    answer = tool_api.responses.create(
        input=[output], previous_response_id=called.id, tool_choice="none", **{**ask, "max_output_tokens": 5}
    )
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    assert answer.usage.input_tokens > called.usage.input_tokens  # the call and its output were rendered


def test_a_namespace_s_function_is_called_by_its_name_and_namespace(tool_api):
    """Codex groups tools in namespaces: the model sees `weather.get_weather`, the call item says
    `get_weather` in namespace `weather` (plain and streamed), and the call goes back in qualified."""
    group = {"type": "namespace", "name": "weather", "description": "Weather.", "tools": [RESPONSES_WEATHER]}
    force = {"type": "function", "name": "get_weather", "namespace": "weather"}
    ask = {"model": "tiny-tools", "tools": [group], "temperature": 0, "max_output_tokens": 100}
    called = tool_api.responses.create(input="Weather in Oslo?", tool_choice=force, **ask)
    (call,) = called.output
    assert (call.name, call.namespace) == ("get_weather", "weather")
    with tool_api.responses.stream(input="Weather in Oslo?", tool_choice=force, **ask) as stream:
        streamed = stream.get_final_response().output[0]
    assert (streamed.name, streamed.namespace, streamed.arguments) == (
        "get_weather",
        "weather",
        call.arguments,
    )
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    answer = tool_api.responses.create(
        input=[output], previous_response_id=called.id, tool_choice="none", **{**ask, "max_output_tokens": 5}
    )
    assert [item.type for item in answer.output] == ["message"]


def test_required_parallel_calls_with_n_and_a_seed(tool_api):
    fields = dict(tools=[WEATHER], tool_choice="required", n=2, temperature=1.0, seed=3, max_tokens=120)
    answers = [ask(tool_api, [{"role": "user", "content": "Oslo and Rome?"}], **fields) for _ in range(2)]
    for choice in answers[0].choices:
        if choice.finish_reason == "tool_calls":  # a random model may use up max_tokens on calls
            assert choice.message.tool_calls and all(
                c.function.name == "get_weather" for c in choice.message.tool_calls
            )
    same = [
        [c.message.tool_calls and [t.function.arguments for t in c.message.tool_calls] for c in a.choices]
        for a in answers
    ]
    assert same[0] == same[1]  # the seed makes the calls reproducible


def test_structured_output_parses_into_the_pydantic_model(tool_api):
    parsed = tool_api.chat.completions.parse(
        model="tiny-tools",
        messages=[{"role": "user", "content": "A city?"}],
        response_format=City,
        # room for the longest answer: 20 escaped characters (6 byte tokens each) and 10 digits; bounds count
        # characters (decoding/json_bounds.py), so a tighter budget can run out on a model sampling escapes
        max_tokens=200,
    )
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and 0 <= city.population <= 10**9
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    small["additionalProperties"] = False
    completion = tool_api.completions.create(
        model="tiny-tools",
        prompt="Answer in JSON:",
        max_tokens=20,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": small}}
        },
    )  # completions take a response format too (an extension: OpenAI's own completions have none)
    assert json.loads(completion.choices[0].text) in ({"ok": True}, {"ok": False})


def test_each_request_gets_a_log_line(tool_api, tool_process):
    # greedy: a sampled answer of this random model may end at its first token (EOS)
    answer = ask(tool_api, [{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
    line = next(line for line in tool_process.log().splitlines() if answer.id in line)
    tokens = answer.usage.completion_tokens
    assert f"completion_tokens={tokens}" in line and "status=200" in line and "ttft=" in line


def test_smollm2_answers_a_schema_with_real_text_and_refuses_tools(smol_openai):
    messages = [{"role": "user", "content": "Name a large city in France and its population."}]
    parsed = smol_openai.chat.completions.parse(
        model="SmolLM2-135M-Instruct", messages=messages, response_format=City, max_tokens=60, temperature=0
    )
    assert isinstance(parsed.choices[0].message.parsed, City)
    with pytest.raises(openai.BadRequestError, match="does not support tools") as error:
        smol_openai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=[WEATHER])
    assert error.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError, match="response_format") as error:
        smol_openai.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=messages,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        )
