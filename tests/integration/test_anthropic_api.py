"""Anthropic's Messages API of `corolla api` (api/anthropic.py) through the official anthropic SDK, on the
shared SmolLM2 swarm: plain and streamed messages (the SDK's own event parser) give exactly the greedy
answer of chat completions; stop reasons, stop sequences and usage are Anthropic's; structured output
matches its schema; count_tokens counts the rendered prompt; bad requests get Anthropic's error shape
naming the field."""

from __future__ import annotations

import anthropic
import pytest
from pydantic import BaseModel

MODEL = "SmolLM2-135M-Instruct"
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
GREEDY = {"temperature": 0}  # the SDK has no sampling arguments: extra body fields, as documented


@pytest.fixture(scope="module")
def claude(smol_api):
    return anthropic.Anthropic(base_url=smol_api.url, api_key="unused", max_retries=0, timeout=120)


def test_messages_plain_and_streamed_equal_chat_completions(claude, smol_openai):
    expected = smol_openai.chat.completions.create(model=MODEL, messages=POEM, max_tokens=24, temperature=0)
    message = claude.messages.create(model=MODEL, max_tokens=24, messages=POEM, extra_body=GREEDY)
    (block,) = message.content
    assert block.type == "text" and block.text == expected.choices[0].message.content
    assert (
        message.role == "assistant" and message.stop_reason == "max_tokens" and message.id.startswith("msg_")
    )
    assert (message.usage.input_tokens, message.usage.output_tokens) == (expected.usage.prompt_tokens, 24)

    with claude.messages.stream(model=MODEL, max_tokens=24, messages=POEM, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == block.text and len(pieces) == 24  # a text delta per token
    assert final.content[0].text == block.text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 24


def test_a_stop_sequence_and_the_end_of_the_answer_are_told_apart(claude):
    capital = [{"role": "user", "content": "What is the capital of France?"}]
    ended = claude.messages.create(model=MODEL, max_tokens=64, messages=capital, extra_body=GREEDY)
    assert (
        ended.stop_reason == "end_turn" and ended.stop_sequence is None and "Paris" in ended.content[0].text
    )
    cut = claude.messages.create(
        model=MODEL, max_tokens=64, messages=capital, stop_sequences=["Paris"], extra_body=GREEDY
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "Paris"
    assert "Paris" not in cut.content[0].text and ended.content[0].text.startswith(cut.content[0].text)


class City(BaseModel):
    name: str
    country: str


def test_output_config_json_schema_gives_an_answer_of_that_schema(claude):
    question = [{"role": "user", "content": "Name a large city and its country, as JSON."}]
    schema = {"format": {"type": "json_schema", "schema": City.model_json_schema()}}
    message = claude.messages.create(
        model=MODEL, max_tokens=200, messages=question, output_config=schema, extra_body=GREEDY
    )
    City.model_validate_json(message.content[0].text)


def test_count_tokens_counts_the_prompt_a_message_sends(claude):
    system = "You are terse."
    counted = claude.messages.count_tokens(model=MODEL, system=system, messages=POEM)
    message = claude.messages.create(model=MODEL, max_tokens=1, system=system, messages=POEM)
    assert counted.input_tokens == message.usage.input_tokens > 10


@pytest.mark.parametrize(
    ("call", "error", "named"),
    [
        ({"model": "claude-sonnet-4-5", "max_tokens": 8, "messages": POEM}, anthropic.NotFoundError, "model"),
        ({"model": MODEL, "max_tokens": 0, "messages": POEM}, anthropic.BadRequestError, "max_tokens"),
        (
            {"model": MODEL, "max_tokens": 8, "messages": POEM, "extra_body": {"temperature": 1.5}},
            anthropic.BadRequestError,
            "temperature",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 8,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "messages": POEM,
            },
            anthropic.BadRequestError,
            "thinking",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 8,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "aGk="},
                            }
                        ],
                    }
                ],
            },
            anthropic.BadRequestError,
            "messages[0].content[0]",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 8,
                "messages": POEM,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            anthropic.BadRequestError,
            "tools[0]",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 8,
                "messages": POEM,
                "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            },
            anthropic.BadRequestError,
            "tools",
        ),
    ],
)
def test_bad_requests_get_anthropics_error_naming_the_field(claude, call, error, named):
    with pytest.raises(error) as raised:
        claude.messages.create(**call)
    body = raised.value.body
    assert body["type"] == "error" and named in body["error"]["message"], body
