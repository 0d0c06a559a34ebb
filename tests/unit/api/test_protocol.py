"""The OpenAI request models: validation errors name the field; translation to SamplingParams."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from corolla.api.chat_protocol import ChatCompletionRequest
from corolla.api.protocol import CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def error_field(model, data) -> str:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return ".".join(str(p) for p in info.value.errors()[0]["loc"])


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"top_k": 0}, "top_k"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
        ),
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages.0.tool_call_id"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools.0.function.name"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_bad_chat_fields_are_named(extra, field):
    assert error_field(ChatCompletionRequest, {**CHAT, **extra}) == field


def test_cross_field_rules():
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest.model_validate({**CHAT, "top_logprobs": 2})
    with pytest.raises(ValidationError, match="stream_options is only allowed"):
        ChatCompletionRequest.model_validate({**CHAT, "stream_options": {"include_usage": True}})
    with pytest.raises(ValidationError, match="echo is not supported"):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": True})


def test_unknown_fields_are_ignored_with_a_log_line(caplog):
    with caplog.at_level("INFO", logger="corolla.api.protocol"):
        request = ChatCompletionRequest.model_validate({**CHAT, "tools_v9": [], "mood": "happy"})
    assert request.messages[0].text() == "hi"
    assert "mood" in caplog.text and "tools_v9" in caplog.text


def test_translation_to_sampling_params():
    request = ChatCompletionRequest.model_validate(
        {
            **CHAT,
            "temperature": 0,
            "stop": "\n",
            "seed": 7,
            "presence_penalty": 0.5,
            "logit_bias": {"3": -100},
            "top_k": -1,
            "repetition_penalty": 1.2,
        }
    )
    params = request.to_sampling_params(max_tokens=10, logprobs=2, vocab_size=100)
    assert not params.do_sample and params.max_new_tokens == 10 and params.stop == ("\n",)
    assert params.seed == 7 and params.presence_penalty == 0.5 and params.logit_bias == ((3, -100.0),)
    assert params.top_k is None and params.repetition_penalty == 1.2 and params.logprobs == 2
    sampled = ChatCompletionRequest.model_validate({**CHAT, "temperature": 0.7}).to_sampling_params(
        5, None, 100
    )
    assert sampled.do_sample and sampled.temperature == 0.7
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ChatCompletionRequest.model_validate({**CHAT, "logit_bias": {"100": 1}}).to_sampling_params(
            5, None, 100
        )


def test_completion_prompt_forms():
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x"}).prompts() == ["x"]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompts() == [[1, 2]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert error_field(CompletionRequest, {"model": "m", "prompt": []}) == "prompt"
    assert error_field(CompletionRequest, {"model": "m"}) == "prompt"


def test_developer_messages_are_system_messages_for_templates():
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]}]}
    )
    assert request.template_messages() == [{"role": "system", "content": "be brief"}]
