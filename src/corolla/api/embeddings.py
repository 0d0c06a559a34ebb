"""POST /v1/embeddings: each input's final hidden states, pooled into one unit vector
(client/training/embeddings.py).

`EmbeddingServing` tokenizes and checks the inputs here, on the API's loop, then runs the forward pass as
a job on the model's loop and awaits it without blocking the HTTP server; a client that goes away
cancels the job. A few requests run on the swarm at once and the rest wait their turn: servers refuse a
peer's forward passes beyond max_passes_per_peer, and a refusal would count as the server failing.
No HTTP here beyond `install_routes`, which registers the route through app.py's `generate`.
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response

from corolla.api.extra_protocol import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from corolla.api.protocol import ErrorResponse, error_for
from corolla.client.training.embeddings import Pooling

if TYPE_CHECKING:
    from corolla.api.http import Generate
    from corolla.api.serving import OpenAIServing

MAX_RUNNING = 4  # embedding requests on the swarm at once (each runs its batches one after another)


class EmbeddingServing:
    def __init__(self, serving: OpenAIServing, pooling: Pooling):
        self.serving = serving
        self.pooling = pooling
        self._running = asyncio.Semaphore(MAX_RUNNING)  # bound to the API's loop on first use

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse | ErrorResponse:
        sequences = self.token_ids(request)
        if isinstance(sequences, ErrorResponse):
            return sequences
        model = self.serving.model
        num_tokens = sum(len(ids) for ids in sequences)
        self.serving.metrics.prompt_tokens.inc(num_tokens)
        try:
            async with self._running:
                job = model.aembed(sequences, self.pooling)
                vectors = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(job, model.runtime.loop))
        except Exception as e:  # not BaseException: a cancelled request (client gone) stays cancelled
            return error_for(e)
        data = [
            Embedding(index=i, embedding=encode(vector, request.encoding_format))
            for i, vector in enumerate(vectors)
        ]
        usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        return EmbeddingResponse(data=data, model=self.serving.name, usage=usage)

    def token_ids(self, request: EmbeddingRequest) -> list[list[int]] | ErrorResponse:
        """Each input's token ids, or the 400 for the first input that is empty, too long or holds ids
        outside the vocabulary. Texts are tokenized as completions' prompts are."""
        tokenizer = self.serving.model.tokenizer
        vocab = self.serving.model.config.vocab_size
        limit = self.serving.max_model_len
        inputs = request.inputs()
        sequences = []
        for i, given in enumerate(inputs):
            ids = list(given) if isinstance(given, list) else tokenizer(given).input_ids
            which = "input" if len(inputs) == 1 else f"input {i}"
            if not ids:
                return _invalid(f"{which} is empty: it has no tokens to embed")
            if len(ids) > limit:
                return _invalid(f"{which} has {len(ids)} tokens; this model's context is {limit}")
            if any(not 0 <= t < vocab for t in ids):
                return _invalid(f"{which} holds token ids outside the vocabulary of {vocab}")
            sequences.append(ids)
        return sequences


def encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """A float32 vector as JSON floats, or base64 of its little-endian bytes (as OpenAI sends it; its
    Python client decodes it with numpy.frombuffer(..., dtype="float32"))."""
    values = vector.to(torch.float32).contiguous()
    if encoding_format == "base64":
        return base64.b64encode(values.numpy().astype("<f4").tobytes()).decode("ascii")
    return values.tolist()


def _invalid(message: str) -> ErrorResponse:
    return ErrorResponse.make(400, message, "invalid_request_error", "input")


def install_routes(app: FastAPI, generate: Generate, serving: OpenAIServing, pooling: Pooling) -> None:
    """Register POST /v1/embeddings, parsed, checked against the served model and raced with the
    client's disconnect by app.py's `generate`, as completions are."""
    embeddings = EmbeddingServing(serving, pooling)

    @app.post("/v1/embeddings")
    async def create_embedding(request: Request) -> Response:
        return await generate(request, "embeddings", EmbeddingRequest, embeddings.create_embedding)
