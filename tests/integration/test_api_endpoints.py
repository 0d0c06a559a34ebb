"""`corolla api`'s endpoints beside generation, on the local SmolLM2 swarm, through the official `openai`
package and raw HTTP: /v1/embeddings (shape, unit norm, determinism, base64, batches against single
inputs, and the Python client's own forward pass), /v1/models/{id}, vLLM's /tokenize and /detokenize,
/version."""

from __future__ import annotations

import importlib.metadata
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from openai import OpenAI

MODEL = "SmolLM2-135M-Instruct"
HIDDEN = 576
TEXTS = ["The sea is calm tonight.", "A distributed swarm of machines runs one language model together."]
# measured on this swarm: padded batches and single inputs differ by at most 4.2e-7 per value (20 inputs
# of 4..80 tokens, mean and last pooling); two calls of the same batch by 0 (another route could differ)
TOLERANCE = 1e-5


def request(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    sent = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(sent, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def vectors(client: OpenAI, inputs, encoding_format="float") -> np.ndarray:
    answer = client.embeddings.create(model=MODEL, input=inputs, encoding_format=encoding_format)
    assert [d.index for d in answer.data] == list(range(len(answer.data)))
    return np.array([d.embedding for d in answer.data], dtype=np.float32)


def test_embeddings_are_unit_vectors_of_the_hidden_size_and_deterministic(smol_openai):
    answer = smol_openai.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64
    first = np.array([d.embedding for d in answer.data], dtype=np.float32)
    assert first.shape == (2, HIDDEN)
    np.testing.assert_allclose(np.linalg.norm(first, axis=1), 1.0, atol=1e-5)
    assert answer.model == MODEL and answer.usage.prompt_tokens == answer.usage.total_tokens > 10
    assert float(first[0] @ first[1]) < 0.999  # two different texts
    again = vectors(smol_openai, TEXTS, "float")  # as floats this time
    np.testing.assert_allclose(again, first, rtol=0, atol=TOLERANCE)


def test_a_batch_equals_single_requests(smol_openai):
    batch = vectors(smol_openai, TEXTS)
    single = np.concatenate([vectors(smol_openai, text) for text in TEXTS])
    np.testing.assert_allclose(batch, single, rtol=0, atol=TOLERANCE)


def test_embeddings_are_the_pooled_final_states_of_the_python_clients_forward(smol_openai, smol_client):
    ids = smol_client.tokenizer(TEXTS[0]).input_ids
    with torch.no_grad():
        states = smol_client.head.norm(smol_client.forward(torch.tensor([ids])).hidden_states[0])
    wanted = torch.nn.functional.normalize(states.float().mean(dim=0), dim=0).numpy()
    np.testing.assert_allclose(vectors(smol_openai, [ids])[0], wanted, rtol=0, atol=TOLERANCE)


def test_tokenize_and_detokenize_round_trip(smol_api, smol_client):
    status, tokens = request(f"{smol_api.url}/tokenize", {"model": MODEL, "prompt": TEXTS[1]})
    assert status == 200 and tokens["tokens"] == smol_client.tokenizer(TEXTS[1]).input_ids
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    assert request(f"{smol_api.url}/detokenize", {"tokens": tokens["tokens"]}) == (200, {"prompt": TEXTS[1]})
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    text = smol_client.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    status, rendered = request(f"{smol_api.url}/tokenize", {"messages": chat})
    assert rendered["tokens"] == smol_client.tokenizer(text, add_special_tokens=False).input_ids


def test_model_by_id_and_version(smol_api, smol_openai):
    assert smol_openai.models.retrieve(MODEL).id == MODEL
    status, missing = request(f"{smol_api.url}/v1/models/org/no-such-model")
    assert status == 404 and missing["error"]["code"] == "model_not_found"
    assert request(f"{smol_api.url}/version") == (200, {"version": importlib.metadata.version("corolla")})


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/embeddings", {"model": MODEL, "input": "hi", "dimensions": 64}, "dimensions"),
        ("/v1/embeddings", {"model": MODEL, "input": [49152]}, "input"),
        ("/v1/embeddings", {"model": MODEL, "input": "word " * 1100}, "input"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
    ],
)
def test_bad_requests_name_the_field(smol_api, route, body, param):
    status, answer = request(f"{smol_api.url}{route}", body)
    assert status == 400 and answer["error"]["param"] == param, answer
