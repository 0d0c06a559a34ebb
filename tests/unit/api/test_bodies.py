"""The API's body parsing over HTTP: every malformed body is a 4xx in OpenAI's error shape, never a 500,
it never reaches serving, and the server answers the next request as before."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from corolla.api.app import build_app
from corolla.api.http import MAX_BODY_BYTES
from corolla.api.metrics import ApiMetrics
from corolla.api.request_log import RequestLog

CHAT = b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}]'
DEEP = 100_000


class EchoServing:
    """Stands in for OpenAIServing: answers each request with the request as it was parsed."""

    name = "fake"

    def __init__(self):
        self.metrics, self.received = ApiMetrics(), []
        self.tracker = SimpleNamespace(num_active=0, abort_all=lambda: None)
        self.log = RequestLog()

    async def create_chat_completion(self, request):
        self.received.append(request)
        return request

    create_completion = create_chat_completion


@pytest.fixture
def serving():
    return EchoServing()


@pytest.fixture
def client(serving):
    with TestClient(build_app(serving), raise_server_exceptions=False) as client:
        yield client


def post(client, body: bytes, route: str = "/v1/chat/completions"):
    return client.post(route, content=body, headers={"content-type": "application/json"})


def assert_serves(client, serving):
    answer = post(client, CHAT + b', "max_tokens": 7}')
    assert answer.status_code == 200 and answer.json()["max_tokens"] == 7
    assert len(serving.received) == 1


BAD = {
    "nested messages": (b'{"model": "fake", "messages": ' + b"[" * DEEP + b"]" * DEEP + b"}", "body"),
    "nested array": (b"[" * DEEP + b"]" * DEEP, "body"),
    "nested object": (CHAT + b', "extra": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}", "body"),
    "5000-digit int": (CHAT + b', "max_tokens": 1' + b"0" * 5000 + b"}", "body"),
    "5000-digit float": (CHAT + b', "temperature": 1' + b"0" * 5000 + b".5}", "body"),
    "5000-digit int string": (CHAT + b', "max_tokens": "1' + b"0" * 5000 + b'"}', "max_tokens"),
    "not JSON": (b"{not json", "body"),
    "empty": (b"", "body"),
    "trailing bytes": (CHAT + b"} {}", "body"),
    "not UTF-8": (b'{"model": "fake\xff", "messages": []}', "body"),
    "lone surrogate": (CHAT.replace(b'"hi"', b'"\\ud800"') + b"}", "body"),
    "an array": (b"[1, 2]", "body"),
    "a string": (b'"hello"', "body"),
    "null": (b"null", "body"),
    "a wrong field": (CHAT + b', "temperature": "hot"}', "temperature"),
}


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("body", "param"), list(BAD.values()), ids=list(BAD))
def test_malformed_bodies_are_400s_in_openai_shape(client, serving, route, body, param):
    if route == "/v1/completions":
        body = body.replace(b'"messages": [{"role": "user", "content": "hi"}]', b'"prompt": "hi"')
        body = body.replace(b'"messages": ', b'"prompt": ')
    answer = post(client, body, route)
    assert answer.status_code == 400, answer.text[:300]
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert set(answer.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    assert len(error["message"]) < 500
    assert not serving.received
    assert_serves(client, serving)


def test_a_body_over_the_limit_is_a_413_in_openai_shape(client, serving):
    padding = b" " * (MAX_BODY_BYTES + 1 - len(CHAT) - 1)
    answer = post(client, CHAT + padding + b"}")
    assert answer.status_code == 413
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "body"
    assert str(MAX_BODY_BYTES) in error["message"] and not serving.received
    assert post(client, CHAT + padding[:-1] + b"}").status_code == 200  # at the limit: served


def test_a_streamed_body_over_the_limit_is_a_413(client, serving):
    def chunks():
        yield CHAT[:-1]
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 1):
            yield b" " * (1 << 20)
        yield b"}"

    answer = client.post("/v1/chat/completions", content=chunks())
    assert answer.status_code == 413 and answer.json()["error"]["param"] == "body"
    assert_serves(client, serving)


def test_well_formed_bodies_still_parse(client, serving):
    nested = b"[" * 150 + b"]" * 150
    answer = post(client, b"\xef\xbb\xbf" + CHAT + b', "extra": ' + nested + b', "max_tokens": 10}')
    assert answer.status_code == 200 and answer.json()["max_tokens"] == 10
    text = '{"model": "fake", "messages": [{"role": "user", "content": "h\\u00e9 \\ud83d\\ude00 ü"}]}'
    answer = post(client, text.encode())
    assert answer.status_code == 200 and answer.json()["messages"][0]["content"] == "hé 😀 ü"


def test_cross_field_errors_name_the_body(client):
    answer = post(client, CHAT + b', "top_logprobs": 2}')
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "body"
    assert "top_logprobs needs logprobs" in answer.json()["error"]["message"]


def test_a_bug_is_a_500_in_openai_shape_and_the_server_keeps_serving(client, serving):
    async def broken(request):
        raise RuntimeError("a bug")

    serving.create_completion = broken
    answer = post(client, b'{"model": "fake", "prompt": "hi"}', "/v1/completions")
    assert answer.status_code == 500
    assert answer.json()["error"] == {
        "message": "internal error: RuntimeError",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert_serves(client, serving)
