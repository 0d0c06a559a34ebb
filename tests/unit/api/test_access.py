"""Who may call the API: keys on /v1 and /api routes (401s in OpenAI's shape), CORS for allowed origins
only, and a request id on every answer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from corolla.api.app import build_app
from corolla.api.metrics import ApiMetrics
from corolla.api.protocol import ModelCard, ModelList
from corolla.api.request_log import RequestLog
from corolla.config import ApiConfig

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


class Serving:
    """Stands in for OpenAIServing: a model list, and chat requests answered with themselves."""

    name = "fake"

    def __init__(self):
        self.metrics = ApiMetrics()
        self.tracker = SimpleNamespace(num_active=0, abort_all=lambda: None)
        self.log = RequestLog()

    def models(self):
        return ModelList(data=[ModelCard(id=self.name, max_model_len=64)])

    async def create_chat_completion(self, request):
        return request


@pytest.fixture
def client():
    app = build_app(
        Serving(), ApiConfig(api_keys=("key-one", "key-two"), allowed_origins=("https://app.example",))
    )
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def test_v1_routes_need_one_of_the_keys(client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic key-one"}):
        answer = client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert answer.status_code == 401, headers
        error = answer.json()["error"]
        assert error["code"] == "invalid_api_key" and "--api-key" in error["message"]
        assert answer.headers["WWW-Authenticate"] == "Bearer"
    for key in ("key-one", "key-two"):
        answer = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200 and answer.json()["model"] == "fake"
    answer = client.post(
        "/v1/chat/completions", json=CHAT, headers={"x-api-key": "key-two"}
    )  # Anthropic's SDKs
    assert answer.status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "wrong"}).status_code == 401
    assert client.get("/v1/models").status_code == 401
    assert client.get("/api/tags").status_code == 401  # Ollama's routes too
    assert client.post("/api/chat", json=CHAT).status_code == 401
    assert client.get("/health").status_code == 200  # probes carry no keys


def test_without_keys_everything_is_open():
    with TestClient(build_app(Serving())) as client:
        assert client.get("/v1/models").status_code == 200
        assert (
            "access-control-allow-origin"
            not in client.get("/v1/models", headers={"Origin": "https://x"}).headers
        )


def test_cors_answers_allowed_origins_only(client):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    answer = client.options("/v1/chat/completions", headers=preflight)
    assert (
        answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example"
    )
    other = client.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    refused = client.get("/v1/models", headers={"Origin": "https://app.example"})  # no key: 401, readable
    assert (
        refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://app.example"
    )


def test_every_answer_carries_a_request_id(client):
    mine = client.get("/health", headers={"X-Request-Id": "abc-123"})
    assert mine.headers["X-Request-Id"] == "abc-123"
    fresh = [client.get("/health").headers["X-Request-Id"] for _ in range(2)]
    assert len(set(fresh)) == 2 and all(len(i) == 32 for i in fresh)
    assert client.get("/v1/models").headers["X-Request-Id"]  # refusals too
    assert client.get("/health", headers={"X-Request-Id": "x" * 500}).headers["X-Request-Id"] != "x" * 500
