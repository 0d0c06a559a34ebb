"""`DistributedModelForCausalLM`: a causal LM whose transformer blocks run on the swarm.

The client loads only the embeddings, final norm and LM head; every block runs on servers found through
the DHT. One model object serves any number of concurrent sessions, from threads (synchronous methods)
or from its own event loop (the `a*` coroutines).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch

from corolla.client.generation import GenerationStep, generate_steps
from corolla.client.head_batcher import HeadBatcher
from corolla.client.inference_session import InferenceSession
from corolla.client.remote_forward import remote_forward
from corolla.client.runtime import LoopThread
from corolla.client.sampling import SamplingParams
from corolla.client.swarm import RETRYABLE, SwarmClient
from corolla.config import ClientConfig
from corolla.errors import InvalidRequest
from corolla.models.config import ModelConfig, parse_dtype
from corolla.models.head import ModelHead
from corolla.models.source import ModelSource, dht_prefix_for, resolve_model


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, T, vocab]
    hidden_states: torch.Tensor  # [B, T, hidden], the last block's outputs (before the final norm)


class DistributedModelForCausalLM:
    def __init__(
        self,
        source: ModelSource,
        config: ModelConfig,
        head: ModelHead,
        swarm: SwarmClient,
        runtime: LoopThread,
    ):
        self.source, self.config, self.head, self.swarm, self.runtime = source, config, head, swarm, runtime
        self.head_batcher = HeadBatcher(head)

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        initial_peers: Sequence[str] = (),
        *,
        dht_prefix: str | None = None,
        config: ClientConfig | None = None,
        **overrides: Any,
    ) -> DistributedModelForCausalLM:
        """Load the local parts of `model` and join the swarm through `initial_peers`.

        `overrides` are ClientConfig fields (request_timeout, routing_timeout, allowed_servers, ...).
        """
        config = replace(config or ClientConfig(), **overrides)
        if initial_peers:
            config = replace(config, swarm=replace(config.swarm, initial_peers=tuple(initial_peers)))
        source = resolve_model(model)
        model_config = ModelConfig.from_folder(source.path)
        head = ModelHead.load(source.path, parse_dtype(config.dtype, model_config))
        prefix = dht_prefix or config.dht_prefix or dht_prefix_for(source.name)
        runtime = LoopThread()
        swarm = SwarmClient(config, prefix, model_config.num_hidden_layers)
        try:
            runtime.run(swarm.start())
        except BaseException:
            runtime.stop()
            raise
        return cls(source, model_config, head, swarm, runtime)

    # --- tokenizer and special tokens ----------------------------------------------------------------------

    @cached_property
    def tokenizer(self) -> Any:
        """The model folder's tokenizer (transformers' AutoTokenizer), or None if the folder has none."""
        if not any(
            (self.source.path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
        ):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.source.path)

    @cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.config.eos_token_ids)
        path = self.source.path / "generation_config.json"
        if path.is_file():
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            ids += eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
        return tuple(dict.fromkeys(ids))

    @property
    def pad_token_id(self) -> int:
        if self.config.pad_token_id is not None:
            return self.config.pad_token_id
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    # --- inference -----------------------------------------------------------------------------------------

    def inference_session(self, max_length: int, alloc_timeout: float = 0.0) -> InferenceSession:
        """A session that keeps server-side caches across calls; use it as a context manager."""
        return InferenceSession(self.swarm, self.runtime, max_length, alloc_timeout)

    async def agenerate(
        self,
        input_ids: torch.Tensor | Sequence[int],
        params: SamplingParams | None = None,
        session: InferenceSession | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[torch.Tensor]:
        """Yield each step's new tokens [B]; kwargs are SamplingParams fields."""
        async for step in self.agenerate_steps(input_ids, params, session, **kwargs):
            yield step.tokens

    async def agenerate_steps(
        self,
        input_ids: torch.Tensor | Sequence[int],
        params: SamplingParams | None = None,
        session: InferenceSession | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationStep]:
        """Like `agenerate`, with each row's finished flag and (params.logprobs) log-probabilities.

        Without `session`, one is opened for max_length = prompt + max_new_tokens and closed on every
        server of its chain as soon as the generation ends, fails or is cancelled.
        """
        input_ids = _as_batch(input_ids)
        params = replace(params or SamplingParams(), **kwargs)
        own = session is None
        if own:
            session = await InferenceSession(
                self.swarm, self.runtime, input_ids.shape[1] + params.max_new_tokens
            ).aopen()
        try:
            async for step in generate_steps(
                self.head_batcher,
                session,
                input_ids,
                params,
                self.eos_token_ids,
                self.pad_token_id,
                self.tokenizer if params.stop else None,
            ):
                yield step
        finally:
            if own:
                await session.aclose()

    def generate_stream(
        self,
        input_ids: torch.Tensor | Sequence[int],
        params: SamplingParams | None = None,
        session: InferenceSession | None = None,
        **kwargs: Any,
    ) -> Iterator[torch.Tensor]:
        """A synchronous iterator over each step's new tokens [B], yielded as soon as they are sampled."""
        stream = self.agenerate(input_ids, params, session, **kwargs)
        try:
            while True:
                try:
                    yield self.runtime.run(anext(stream))
                except StopAsyncIteration:
                    return
        finally:
            if self.runtime.loop.is_running():  # after shutdown() there is nothing left to close
                self.runtime.run(stream.aclose())

    def generate(
        self,
        input_ids: torch.Tensor | Sequence[int],
        params: SamplingParams | None = None,
        session: InferenceSession | None = None,
        streamer: Callable[[torch.Tensor], None] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Generate like transformers' `generate`: returns [B, T + new] (inputs followed by new tokens).

        kwargs are SamplingParams fields: max_new_tokens, do_sample, temperature, top_k, top_p,
        repetition_penalty, seed, stop, ignore_eos. `streamer` is called with each step's tokens [B].
        """
        input_ids = _as_batch(input_ids)
        new_tokens = []
        for tokens in self.generate_stream(input_ids, params, session, **kwargs):
            new_tokens.append(tokens[:, None])
            if streamer is not None:
                streamer(tokens)
        return torch.cat([input_ids, *new_tokens], dim=1)

    # --- forward pass --------------------------------------------------------------------------------------

    async def aforward(self, input_ids: torch.Tensor) -> CausalLMOutput:
        input_ids = _as_batch(input_ids)
        config = self.swarm.config
        with torch.no_grad():
            hidden = self.head.embed(input_ids)
            hops, index, failures = await self.swarm.route(), 0, 0
            while index < len(hops):
                try:
                    hidden_out = await remote_forward(
                        self.swarm.p2p, hops[index], self.swarm.dht_prefix, hidden, config.request_timeout
                    )
                except RETRYABLE:
                    failures += 1
                    if failures > config.max_retries:
                        raise
                    self.swarm.ban(hops[index].peer_id)
                    hops[index : index + 1] = await self.swarm.route(hops[index].start, hops[index].end)
                    continue
                hidden, index = hidden_out, index + 1
            return CausalLMOutput(self.head.logits(hidden), hidden)

    def forward(self, input_ids: torch.Tensor) -> CausalLMOutput:
        """Logits for every position of input_ids [B, T] (one pass through the swarm, no cache)."""
        return self.runtime.run(self.aforward(input_ids))

    __call__ = forward

    # --- lifetime ------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        self.head_batcher.shutdown()
        if self.runtime.loop.is_running():
            self.runtime.run(self.swarm.shutdown())
        self.runtime.stop()

    def __enter__(self) -> DistributedModelForCausalLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _as_batch(input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    ids = (
        input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(list(input_ids), dtype=torch.long)
    )
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[1] == 0 or ids.dtype not in (torch.int64, torch.int32):
        raise InvalidRequest(
            f"input_ids must be a non-empty integer tensor [batch, length], got {ids.dtype} {list(ids.shape)}"
        )
    return ids.long()
