"""Anthropic's Messages requests translated into the chat completions corolla serves
(api/anthropic_protocol.py), and the stop reasons its answers carry (api/anthropic_formats.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from corolla.api.anthropic_formats import AnthropicFormat, stop_reason
from corolla.api.anthropic_protocol import MessagesRequest
from corolla.errors import InvalidRequest

ASK = {"role": "user", "content": "weather in Paris?"}


def request(**fields):
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 9, "messages": [ASK], **fields})


def test_sampling_is_plain_unless_the_body_says_otherwise():
    plain = request().to_openai()
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (None, 1.0, None, 9)
    sampling = plain.to_sampling_params(9, None, vocab_size=100)  # the API's default: temperature 1
    assert sampling.do_sample and sampling.temperature == 1.0
    assert not plain.to_sampling_params(9, None, 100, default_temperature=0).do_sample  # the server's default
    assert request(temperature=0.5).to_openai().to_sampling_params(9, None, 100, None, 0).temperature == 0.5
    assert not plain.stream and plain.stop == []
    tuned = request(temperature=0, top_k=5, stop_sequences=["\n\n"], stream=True).to_openai()
    assert (tuned.temperature, tuned.top_k, tuned.stop) == (0, 5, ["\n\n"]) and tuned.include_usage
    assert request(ignore_eos=True).to_openai().ignore_eos and not plain.ignore_eos  # corolla's extension


def test_system_tool_use_and_tool_results_become_chat_messages_and_tools():
    tool = {"name": "get_weather", "description": "weather", "input_schema": {"type": "object"}}
    messages = [
        ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "sunny"}],
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    chat = request(
        system=[{"type": "text", "text": "Be brief."}],
        messages=messages,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    ).to_openai()
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "Be brief." and chat.messages[2].content == "Let me look."
    (call,) = chat.messages[2].tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "toolu_1",
        "get_weather",
        {"city": "Paris"},
    )
    assert (chat.messages[3].tool_call_id, chat.messages[3].content) == ("toolu_1", "sunny")
    assert chat.tools[0].function.parameters == {"type": "object"}
    assert chat.tool_choice.function.name == "get_weather" and not chat.parallel_tool_calls
    assert request(tools=[tool], tool_choice={"type": "any"}).to_openai().tool_choice == "required"


def test_a_failed_tool_result_says_so():
    result = {"type": "tool_result", "tool_use_id": "t", "content": "no such city", "is_error": True}
    call = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    chat = request(
        messages=[ASK, {"role": "assistant", "content": [call]}, {"role": "user", "content": [result]}]
    )
    assert chat.to_openai().messages[-1].content == "Error: no such city"


def test_what_cannot_be_honoured_is_refused_naming_the_field():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}
    with pytest.raises(InvalidRequest, match=r"messages\[0\].content\[1\]"):
        request(
            messages=[{"role": "user", "content": [{"type": "text", "text": "what?"}, image]}]
        ).to_openai()
    with pytest.raises(InvalidRequest, match=r"tools\[0\]"):
        request(tools=[{"type": "bash_20250124", "name": "bash"}]).to_openai()
    with pytest.raises(InvalidRequest, match="thinking"):
        request(thinking={"type": "enabled", "budget_tokens": 1024}).to_openai()
    assert request(thinking={"type": "disabled"}).to_openai().messages[0].content == ASK["content"]
    # adaptive (Claude Code's default): the model thinks when it decides to, and this one never does
    assert request(thinking={"type": "adaptive"}).to_openai().messages[0].content == ASK["content"]


def answered(reason, released, decoded, stops=(), calls=0):
    text = SimpleNamespace(finish_reason=reason, released=released, decoded=decoded, stops=stops)
    return SimpleNamespace(text=text, calls=SimpleNamespace(count=calls) if calls else None)


def test_stop_reasons():
    assert stop_reason(answered("length", "abc", "abc")) == ("max_tokens", None)
    assert stop_reason(answered("stop", "abc", "abc", ("\n",))) == ("end_turn", None)  # the end of text
    assert stop_reason(answered("stop", "ab", "ab\nc", ("x", "\n"))) == ("stop_sequence", "\n")
    assert stop_reason(answered("stop", "", "", calls=1)) == ("tool_use", None)


def test_events_are_named_server_sent_events():
    event = AnthropicFormat.sse({"type": "message_stop"})
    assert event == 'event: message_stop\ndata: {"type": "message_stop"}\n\n'
    error = AnthropicFormat.sse({"error": {"message": "the swarm lost a server", "type": "server_error"}})
    assert error.startswith("event: error\n") and '"type": "api_error"' in error
