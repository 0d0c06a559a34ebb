"""Ollama's requests translated into the OpenAI requests corolla serves (api/ollama_protocol.py)."""

from __future__ import annotations

import json

import pytest

from corolla.api.ollama_protocol import OllamaChatRequest, OllamaGenerateRequest
from corolla.errors import InvalidRequest


def chat(**fields):
    return OllamaChatRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_options_map_onto_sampling_with_ollamas_defaults_where_absent():
    plain = chat().to_openai()
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (0.8, 0.9, 40, 1.0)
    assert plain.stream and plain.include_usage and plain.max_tokens is None  # Ollama streams by default
    options = {
        "temperature": 0,
        "top_k": 0,
        "num_predict": 7,
        "repeat_penalty": 1.2,
        "stop": ["\n"],
        "seed": 3,
    }
    tuned = chat(options={**options, "num_ctx": 8192, "mirostat": 2}, stream=False).to_openai()
    assert (tuned.temperature, tuned.top_k, tuned.max_tokens, tuned.repetition_penalty) == (0, None, 7, 1.2)
    assert tuned.stop == ["\n"] and tuned.seed == 3 and not tuned.stream
    for unlimited in (-1, -2):  # up to the context
        assert chat(options={"num_predict": unlimited}).to_openai().max_tokens is None


def test_format_becomes_a_response_format():
    assert chat(format="json").to_openai().response_format.type == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    wanted = chat(format=schema).to_openai().response_format
    assert wanted.type == "json_schema" and wanted.json_schema.schema_ == schema


def test_tool_messages_answer_the_calls_before_them_by_tool_name():
    messages = [
        {"role": "user", "content": "weather in Paris and the time?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"function": {"name": "weather", "arguments": {"city": "Paris"}}},
                {"function": {"name": "clock", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_name": "clock", "content": "12:00"},
        {"role": "tool", "tool_name": "weather", "content": "sunny"},
    ]
    request = chat(messages=messages).to_openai()
    calls = request.messages[1].tool_calls
    assert [c.function.name for c in calls] == ["weather", "clock"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert [m.tool_call_id for m in request.messages[2:]] == [calls[1].id, calls[0].id]


def test_what_cannot_be_honoured_is_refused_naming_the_field():
    with pytest.raises(InvalidRequest, match=r"messages\[0\].images"):
        chat(messages=[{"role": "user", "content": "what is this?", "images": ["aGk="]}]).to_openai()
    with pytest.raises(InvalidRequest, match="think"):
        chat(think=True).to_openai()
    with pytest.raises(InvalidRequest, match="suffix"):
        OllamaGenerateRequest(model="m", prompt="def f(", suffix="return x").to_openai(tokenizer=None)
