"""The small routes with a fake model: /v1/models/{id} (slashes in ids, OpenAI's 404), vLLM's /tokenize
(a prompt or a chat, through the chat template) and /detokenize, /version, and which of them need a key."""

from __future__ import annotations

import importlib.metadata
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from corolla.api.app import build_app
from corolla.api.metrics import ApiMetrics
from corolla.api.protocol import ModelCard, ModelList
from corolla.api.request_log import RequestLog
from corolla.config import ApiConfig

BOS, VOCAB = 1, 200
CHAT = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]


class Tokenizer:
    """One token per character (id = code point); BOS first when special tokens are added."""

    chat_template = "{{ messages }}"  # reads no `tools`

    def __call__(self, text, add_special_tokens=True):
        return SimpleNamespace(input_ids=[BOS] * add_special_tokens + [ord(c) for c in text])

    def decode(self, ids, clean_up_tokenization_spaces=True):
        return "".join("<s>" if t == BOS else chr(t) for t in ids)

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=True):
        if messages[0]["role"] == "assistant":
            raise ValueError("conversations start with a user or system turn")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class Serving:
    name = "org/fake-model"
    max_model_len = 48

    def __init__(self):
        self.model = SimpleNamespace(tokenizer=Tokenizer(), config=SimpleNamespace(vocab_size=VOCAB))
        self.metrics = ApiMetrics()
        self.tracker = SimpleNamespace(num_active=0, abort_all=lambda: None)
        self.log = RequestLog()

    def models(self):
        return ModelList(data=[ModelCard(id=self.name, max_model_len=self.max_model_len)])


@pytest.fixture
def client():
    with TestClient(build_app(Serving()), raise_server_exceptions=False) as client:
        yield client


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_a_model_by_id_even_with_slashes_or_a_404_in_openai_shape(client):
    card = client.get("/v1/models/org/fake-model")
    assert card.status_code == 200
    assert card.json()["id"] == "org/fake-model" and card.json()["object"] == "model"
    missing = client.get("/v1/models/org/other")
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert (
        error["code"] == "model_not_found" and error["param"] == "model" and "org/other" in error["message"]
    )


def test_tokenize_a_prompt_with_or_without_special_tokens(client):
    answer = client.post("/tokenize", json={"prompt": "hey"}).json()
    assert answer == {"count": 4, "max_model_len": 48, "tokens": [BOS, *ids("hey")]}
    bare = client.post(
        "/tokenize", json={"model": "org/fake-model", "prompt": "hey", "add_special_tokens": False}
    )
    assert bare.json()["tokens"] == ids("hey")


def test_tokenize_a_chat_as_chat_completions_render_it(client):
    answer = client.post("/tokenize", json={"messages": CHAT}).json()
    assert answer["tokens"] == ids("<system>be brief<user>hi<assistant>")  # developer is system
    no_prompt = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == ids("<system>be brief<user>hi")
    special = client.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True}).json()
    assert special["tokens"][0] == BOS


def test_detokenize_round_trips(client):
    tokens = client.post("/tokenize", json={"prompt": "round trip"}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "<s>round trip"}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


TOOL = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("route", "body", "status", "param", "words"),
    [
        ("/tokenize", {}, 400, "prompt", "Field required"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt", "not both"),
        ("/tokenize", {"messages": []}, 400, "messages", "at least 1"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", "'user'"),
        ("/tokenize", {"messages": [{"role": "assistant", "content": "x"}]}, 400, "messages", "rejected"),
        ("/tokenize", {"messages": CHAT, "tools": [TOOL]}, 400, "tools", "does not support tools"),
        ("/tokenize", [1, 2], 400, "body", "discriminator"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model", "does not exist"),
        ("/detokenize", {"tokens": [65, VOCAB]}, 400, "tokens", "vocabulary of 200"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens", "vocabulary"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0", "integer"),
        ("/detokenize", {"model": "other", "tokens": [65]}, 404, "model", "does not exist"),
    ],
)
def test_bad_requests_name_the_field(client, route, body, status, param, words):
    answer = client.post(route, json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_version(client):
    assert client.get("/version").json() == {"version": importlib.metadata.version("corolla")}


def test_tokenize_and_detokenize_need_a_key_and_version_does_not():
    app = build_app(Serving(), ApiConfig(api_keys=("sesame",)))
    with TestClient(app, raise_server_exceptions=False) as client:
        for route, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [65]})):
            assert client.post(route, json=body).status_code == 401
            keyed = client.post(route, json=body, headers={"Authorization": "Bearer sesame"})
            assert keyed.status_code == 200
        assert client.get("/v1/models/org/fake-model").status_code == 401
        assert client.get("/version").status_code == 200
