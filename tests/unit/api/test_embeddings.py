"""/v1/embeddings with a fake model: pooling over right-padded batches (exact against single sequences
through a causal stand-in for the swarm), batching, the response's shapes (floats and base64), and the
400s, 404s and 503s of bad requests and a failing swarm."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from corolla.api.app import build_app
from corolla.api.metrics import ApiMetrics
from corolla.api.protocol import ModelCard, ModelList
from corolla.api.request_log import RequestLog
from corolla.client.runtime import LoopThread
from corolla.client.training.embeddings import MAX_PASS_ROWS, batches, embed_sequences, pool
from corolla.config import ApiConfig
from corolla.errors import MissingBlocks

HIDDEN, VOCAB = 8, 100


class CausalPasses:
    """Stands in for the swarm's forward passes: each position's output mixes it with every position
    before it (causal, like attention), so padding after a row's tokens must not change them."""

    def __init__(self):
        self.shapes, self.error = [], None
        self.swarm = SimpleNamespace(config=SimpleNamespace(max_request_tokens=4096))

    async def forward(self, hidden, prompts):
        self.shapes.append(tuple(hidden.shape[:2]))
        if self.error is not None:
            raise self.error
        steps = torch.arange(1, hidden.shape[1] + 1)[None, :, None]
        return torch.tanh(hidden.cumsum(dim=1) / steps + hidden), []


class Head:
    def __init__(self):
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(VOCAB, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        torch.nn.init.normal_(self.norm.weight)

    def embed(self, ids):
        return self.table(ids)


class Tokenizer:
    """One token per character (id = code point - 32)."""

    def __call__(self, text, add_special_tokens=True):
        return SimpleNamespace(input_ids=[ord(c) - 32 for c in text])


class Model:
    def __init__(self):
        self.head, self.tokenizer, self.ptune, self.pad_token_id = Head(), Tokenizer(), None, 0
        self.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=64)
        self.client = SimpleNamespace(passes=CausalPasses())
        self.runtime = LoopThread("fake-model")

    async def aembed(self, sequences, pooling):
        return await embed_sequences(self.client.passes, self.head, self.pad_token_id, sequences, pooling)


class Serving:
    name = "org/fake"
    max_model_len = 32

    def __init__(self):
        self.model, self.metrics = Model(), ApiMetrics()
        self.tracker = SimpleNamespace(num_active=0, abort_all=lambda: None)
        self.log = RequestLog()

    def models(self):
        return ModelList(data=[ModelCard(id=self.name, max_model_len=self.max_model_len)])


@pytest.fixture
def serving():
    serving = Serving()
    yield serving
    serving.model.runtime.stop()


@pytest.fixture
def client(serving):
    with TestClient(build_app(serving), raise_server_exceptions=False) as client:
        yield client


def embed(model, sequences, pooling="mean"):
    return model.runtime.run(model.aembed(sequences, pooling))


# --- pooling and batching ----------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_padded_batches_equal_each_sequence_alone(serving, pooling):
    model = serving.model
    sequences = [[5, 6, 7, 8, 9], [3], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
    together = embed(model, sequences, pooling)
    alone = torch.cat([embed(model, [ids], pooling) for ids in sequences])
    assert together.shape == (4, HIDDEN) and together.dtype == torch.float32
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-6)
    torch.testing.assert_close(together.norm(dim=-1), torch.ones(4))
    assert model.client.passes.shapes[0] == (4, 7)  # one padded pass for the four


def test_mean_and_last_pool_the_normed_states_of_real_tokens_only(serving):
    norm = serving.model.head.norm
    outputs = torch.randn(2, 4, HIDDEN)
    outputs[1, 2:] = float("inf")  # the second row's padding: it must not leak into its vector
    mean, last = pool(norm, outputs, [4, 2], "mean"), pool(norm, outputs, [4, 2], "last")
    with torch.no_grad():
        wanted_mean = torch.stack([norm(outputs[0]).mean(0), norm(outputs[1, :2]).mean(0)])
        wanted_last = torch.stack([norm(outputs[0, 3]), norm(outputs[1, 1])])
    torch.testing.assert_close(mean, torch.nn.functional.normalize(wanted_mean, dim=-1))
    torch.testing.assert_close(last, torch.nn.functional.normalize(wanted_last, dim=-1))


def test_batches_sort_by_length_and_bound_rows_and_tokens():
    lengths = [5, 1, 3, 300, 2] + [1] * 10
    groups = batches(lengths, max_tokens=600)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        assert len(group) <= MAX_PASS_ROWS
        assert len(group) == 1 or len(group) * max(lengths[i] for i in group) <= 600
    assert [lengths[i] for group in groups for i in group] == sorted(lengths)
    assert batches([5000], max_tokens=100) == [[0]]  # one row always runs, however long


# --- the route ---------------------------------------------------------------------------------------------


def test_embeddings_in_openai_shape_and_order(client, serving):
    answer = client.post(
        "/v1/embeddings", json={"model": "org/fake", "input": ["hello", "hi", "a longer one"]}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "list" and body["model"] == "org/fake"
    assert body["usage"] == {"prompt_tokens": 19, "total_tokens": 19}
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" and len(d["embedding"]) == HIDDEN for d in body["data"])
    hello = embed(serving.model, [[ord(c) - 32 for c in "hello"]])[0]
    torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]), hello)


def test_base64_is_the_little_endian_float32_bytes(client):
    floats = client.post("/v1/embeddings", json={"model": "org/fake", "input": [[1, 2, 3], [4]]}).json()
    packed = client.post(
        "/v1/embeddings", json={"model": "org/fake", "input": [[1, 2, 3], [4]], "encoding_format": "base64"}
    ).json()
    for plain, coded in zip(floats["data"], packed["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(coded["embedding"]), dtype="<f4")
        assert decoded.tolist() == plain["embedding"]


def test_the_pooling_flag_reaches_the_route(serving):
    with TestClient(build_app(serving, ApiConfig(embedding_pooling="last"))) as client:
        body = client.post("/v1/embeddings", json={"model": "org/fake", "input": [1, 2, 3]}).json()
    wanted = embed(serving.model, [[1, 2, 3]], "last")[0]
    torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]), wanted)


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"input": "hi"}, 400, "model", "Field required"),
        ({"model": "org/fake", "input": ""}, 400, "input", "empty"),
        ({"model": "org/fake", "input": ["ok", ""]}, 400, "input", "input 1 is empty"),
        ({"model": "org/fake", "input": []}, 400, "input", "must not be empty"),
        ({"model": "org/fake", "input": [[1], []]}, 400, "input", "input 1 is empty"),
        ({"model": "org/fake", "input": "x" * 33}, 400, "input", "context is 32"),
        ({"model": "org/fake", "input": [1, 100]}, 400, "input", "vocabulary of 100"),
        ({"model": "org/fake", "input": [[1], [-1]]}, 400, "input", "input 1 holds"),
        ({"model": "org/fake", "input": ["a"] * 65}, 400, "input", "at most 64 inputs"),
        ({"model": "org/fake", "input": "hi", "dimensions": 4}, 400, "dimensions", "not supported"),
        ({"model": "org/fake", "input": "hi", "encoding_format": "int8"}, 400, "encoding_format", "float"),
        ({"model": "other", "input": "hi"}, 404, "model", "does not exist"),
    ],
)
def test_bad_requests_name_the_field(client, serving, body, status, param, words):
    answer = client.post("/v1/embeddings", json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert serving.model.client.passes.shapes == []  # nothing reached the swarm


def test_null_dimensions_and_user_are_accepted(client):
    body = {"model": "org/fake", "input": "hi", "dimensions": None, "user": "someone"}
    assert client.post("/v1/embeddings", json=body).status_code == 200


def test_swarm_errors_map_like_generations(client, serving):
    serving.model.client.passes.error = MissingBlocks("no server holds blocks 3..5")
    answer = client.post("/v1/embeddings", json={"model": "org/fake", "input": "hi"})
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "missing_blocks"
