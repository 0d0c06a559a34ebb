"""Ollama's API of `corolla api` (api/ollama.py) through the official ollama Python client, on the shared
SmolLM2 swarm: chat and generate, plain and streamed as JSON lines, give exactly the greedy answers of the
OpenAI routes; counts and reasons are Ollama's; structured outputs match their schema; the model list,
its card and the version answer; bad requests get Ollama's error shape naming the field."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import ollama
import pytest
from pydantic import BaseModel

MODEL = "SmolLM2-135M-Instruct"
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
GREEDY = {"temperature": 0, "num_predict": 24}


@pytest.fixture(scope="module")
def client(smol_api):
    return ollama.Client(host=smol_api.url, timeout=120)


def test_chat_plain_and_streamed_equals_chat_completions(client, smol_openai):
    expected = smol_openai.chat.completions.create(model=MODEL, messages=POEM, max_tokens=24, temperature=0)
    answer = client.chat(model=MODEL, messages=POEM, options=GREEDY)
    assert answer.message.role == "assistant"
    assert answer.message.content == expected.choices[0].message.content
    assert answer.done and answer.done_reason == "length"
    assert (answer.prompt_eval_count, answer.eval_count) == (expected.usage.prompt_tokens, 24)
    assert answer.total_duration >= answer.eval_duration > 0 and answer.prompt_eval_duration > 0

    parts = list(client.chat(model=f"{MODEL}:latest", messages=POEM, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == answer.message.content
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "length"
    assert parts[-1].eval_count == 24 and len(parts) == 24 + 1  # a line per token, then the last one


def test_generate_applies_the_chat_template_unless_raw(client, smol_openai):
    chat = client.chat(model=MODEL, messages=POEM, options=GREEDY)
    answer = client.generate(model=MODEL, prompt=POEM[0]["content"], options=GREEDY)
    assert answer.response == chat.message.content and answer.eval_count == 24
    streamed = list(client.generate(model=MODEL, prompt=POEM[0]["content"], options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == answer.response and streamed[-1].done

    raw = client.generate(model=MODEL, prompt="The sea is", raw=True, options=GREEDY)
    completion = smol_openai.completions.create(
        model=MODEL, prompt="The sea is", max_tokens=24, temperature=0
    )
    assert raw.response == completion.choices[0].text
    loaded = client.generate(model=MODEL)  # an empty prompt only loads the model
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


class City(BaseModel):
    name: str
    country: str


def test_format_with_a_json_schema_gives_an_answer_of_that_schema(client):
    question = [{"role": "user", "content": "Name a large city and its country, as JSON."}]
    options = {"temperature": 0, "num_predict": 200}
    answer = client.chat(model=MODEL, messages=question, format=City.model_json_schema(), options=options)
    City.model_validate_json(answer.message.content)
    answer = client.chat(model=MODEL, messages=question, format="json", options=options)
    assert isinstance(json.loads(answer.message.content), dict)


def test_the_model_list_card_and_version(client, smol_api):
    (listed,) = client.list().models
    assert listed.model == MODEL and listed.details.family == "llama"
    card = client.show(MODEL)
    assert card.modelinfo["llama.context_length"] == 1024 and "completion" in card.capabilities
    assert "im_start" in card.template  # the model's own chat template
    with urllib.request.urlopen(f"{smol_api.url}/api/version", timeout=30) as response:
        assert json.load(response)["version"]


@pytest.mark.parametrize(
    ("body", "status", "named"),
    [
        ({"model": "llama3", "messages": POEM}, 404, "llama3"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
            400,
            "images",
        ),
        ({"model": MODEL, "messages": POEM, "options": {"temperature": "hot"}}, 400, "options.temperature"),
        ({"model": MODEL, "messages": POEM, "options": {"num_predict": -3}}, 400, "options.num_predict"),
        ({"model": MODEL, "messages": POEM, "think": True}, 400, "think"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "tool", "content": "42"}]}, 400, "messages[0]"),
    ],
)
def test_bad_requests_get_ollamas_error_naming_the_field(smol_api, body, status, named):
    request = urllib.request.Request(
        f"{smol_api.url}/api/chat", data=json.dumps(body).encode(), method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=60)
    error = json.load(raised.value)
    assert raised.value.code == status and set(error) == {"error"} and named in error["error"], error


def test_the_ollama_client_raises_its_own_error(client):
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="llama3", messages=POEM)
    assert raised.value.status_code == 404 and MODEL in raised.value.error
