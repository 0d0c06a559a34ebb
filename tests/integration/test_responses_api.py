"""OpenAI's Responses API of `corolla api` (api/responses.py) through the official openai SDK, on the shared
SmolLM2 swarm: plain and streamed responses (the SDK's own typed event parser) give exactly the greedy
answer of chat completions; a conversation continued with previous_response_id answers as chat
completions do with the whole conversation, while each turn sends only its new input, and its servers
reuse the prefix they hold; stored responses are read, deleted and kept from other keys; structured
output matches its schema; bad requests get OpenAI's error naming the field. The same conversation gives
the same greedy answer through all four APIs (chat completions, Responses, Messages, Ollama)."""

from __future__ import annotations

import anthropic
import ollama
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel

MODEL = "SmolLM2-135M-Instruct"
CAPITAL = "What is the capital of France?"
GREEDY = {"model": MODEL, "temperature": 0}


@pytest.fixture(scope="module")
def other_key(smol_api):
    """A client with another API key: the server takes any key, and keeps each one's responses apart."""
    return OpenAI(base_url=f"{smol_api.url}/v1", api_key="another", max_retries=0, timeout=120)


def chat(client: OpenAI, messages: list, max_tokens: int):
    return client.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY)


def test_plain_and_streamed_responses_equal_chat_completions(smol_openai):
    expected = chat(smol_openai, [{"role": "user", "content": CAPITAL}], 24)
    response = smol_openai.responses.create(input=CAPITAL, max_output_tokens=24, **GREEDY)
    assert response.status == "completed" and response.id.startswith("resp_")
    assert response.output_text == expected.choices[0].message.content
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.usage.output_tokens == expected.usage.completion_tokens

    with smol_openai.responses.stream(input=CAPITAL, max_output_tokens=24, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == response.output_text
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert len(deltas) >= final.usage.output_tokens - 1  # a delta per token (the end-of-text has none)


def test_a_cut_answer_is_incomplete(smol_openai):
    response = smol_openai.responses.create(input=CAPITAL, max_output_tokens=3, **GREEDY)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"


def test_a_continued_conversation_answers_as_the_whole_chat_and_reuses_the_prefix(smol_openai):
    """The first question is long (~700 tokens of rules, as agents' prompts are): forking the chain that
    holds it pays even where its step times are measured a few times slower than another chain's (on a
    loaded machine a short prefix is rightly prefilled elsewhere: client/generation/prefix_cost.py)."""
    rules = " ".join(f"Rule {i}: answer in one short sentence, politely." for i in range(1, 61))
    questions = [f"{rules} {CAPITAL}", "And of Germany?", "Which of the two is larger?"]
    system = {"role": "system", "content": "Answer briefly."}
    history: list = []
    previous = None
    for i, question in enumerate(questions):
        history.append({"role": "user", "content": question})
        instructions = system["content"] if i == 0 else None  # not carried over, as OpenAI documents
        expected = chat(smol_openai, [system, *history] if instructions else history, 20)
        response = smol_openai.responses.create(
            input=question,
            instructions=instructions,
            previous_response_id=previous,
            max_output_tokens=20,
            **GREEDY,
        )
        assert response.output_text == expected.choices[0].message.content
        assert response.usage.input_tokens == expected.usage.prompt_tokens
        assert response.previous_response_id == previous and response.instructions == instructions
        if i > 0:  # the earlier turns are the prefix the servers hold
            assert response.usage.input_tokens_details.cached_tokens > 0
        history.append({"role": "assistant", "content": response.output_text})
        previous = response.id


def test_stored_responses_are_read_deleted_and_kept_from_other_keys(smol_openai, other_key):
    response = smol_openai.responses.create(input=CAPITAL, max_output_tokens=4, **GREEDY)
    assert smol_openai.responses.retrieve(response.id).output_text == response.output_text
    with pytest.raises(openai.NotFoundError):
        other_key.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as raised:
        other_key.responses.create(previous_response_id=response.id, input="And?", **GREEDY)
    assert raised.value.body["param"] == "previous_response_id"

    smol_openai.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        smol_openai.responses.retrieve(response.id)

    unstored = smol_openai.responses.create(input=CAPITAL, max_output_tokens=4, store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.BadRequestError):
        smol_openai.responses.create(previous_response_id=unstored.id, input="And?", **GREEDY)


class City(BaseModel):
    name: str
    country: str


def test_a_json_schema_text_format_gives_an_answer_of_that_schema(smol_openai):
    question = "Name a large city and its country, as JSON."
    parsed = smol_openai.responses.parse(input=question, text_format=City, max_output_tokens=200, **GREEDY)
    assert isinstance(parsed.output_parsed, City)
    assert parsed.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "Hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"input": "Hi", "background": True}, "background"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "Hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ],
)
def test_bad_requests_get_openais_error_naming_the_field(smol_openai, fields, named):
    with pytest.raises(openai.BadRequestError) as raised:
        smol_openai.responses.create(model=MODEL, **fields)
    assert raised.value.body["param"] == named and named in raised.value.body["message"], raised.value.body


def test_the_same_conversation_gives_one_greedy_answer_through_all_four_apis(smol_api, smol_openai):
    first, second = CAPITAL, "And of Germany?"
    earlier = smol_openai.responses.create(input=first, max_output_tokens=16, **GREEDY)
    conversation = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": earlier.output_text},
        {"role": "user", "content": second},
    ]
    answers = {"chat": chat(smol_openai, conversation, 16).choices[0].message.content}
    responses = smol_openai.responses.create(
        input=second, previous_response_id=earlier.id, max_output_tokens=16, **GREEDY
    )
    answers["responses"] = responses.output_text
    claude = anthropic.Anthropic(base_url=smol_api.url, api_key="unused", max_retries=0, timeout=120)
    message = claude.messages.create(
        model=MODEL, max_tokens=16, messages=conversation, extra_body={"temperature": 0}
    )
    answers["messages"] = message.content[0].text
    local = ollama.Client(host=smol_api.url, timeout=120)
    answers["ollama"] = local.chat(
        model=MODEL, messages=conversation, options={"temperature": 0, "num_predict": 16}
    ).message.content
    assert len(set(answers.values())) == 1 and answers["chat"], answers
