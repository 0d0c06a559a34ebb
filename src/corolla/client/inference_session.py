"""An inference session over a chain of servers that together cover every block.

Each hop keeps its own server-side cache, so a step sends only the new tokens' hidden states. The
session remembers the last token it sampled but has not yet fed to the servers (`pending_token_ids`), so
a multi-turn chat continues where the previous `generate` call stopped. Async methods (`astep`,
`aclose`) run on the client's loop; the plain ones are the synchronous facade.
"""

from __future__ import annotations

import asyncio

import torch

from corolla.client.runtime import LoopThread
from corolla.client.span_session import SpanSession
from corolla.client.swarm import SwarmClient
from corolla.errors import InvalidRequest
from corolla.swarm.routing import Hop


class InferenceSession:
    def __init__(self, swarm: SwarmClient, runtime: LoopThread, max_length: int, alloc_timeout: float = 0.0):
        if max_length < 1:
            raise InvalidRequest(f"max_length must be at least 1, got {max_length}")
        self.swarm, self.runtime, self.max_length = swarm, runtime, max_length
        self.alloc_timeout = alloc_timeout
        self.spans: list[SpanSession] = []
        self.position = 0
        self.pending_token_ids: torch.Tensor | None = None  # [B, 1]: sampled, not yet sent to the servers
        self.boundary_outputs: list[torch.Tensor] = []  # each hop's outputs of the last step (for checks)
        self._opened = False
        self.closed = False

    @property
    def route(self) -> list[Hop]:
        return [span.hop for span in self.spans]

    async def aopen(self) -> InferenceSession:
        hops = await self.swarm.route()
        timeout = self.swarm.config.request_timeout
        self.spans = [
            SpanSession(
                self.swarm.p2p, hop, self.swarm.dht_prefix, self.max_length, timeout, self.alloc_timeout
            )
            for hop in hops
        ]
        try:
            await asyncio.gather(*(span.open() for span in self.spans))
        except BaseException:
            await self.aclose()
            raise
        self._opened = True
        return self

    async def astep(
        self,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None = None,
        hypo_ids: torch.Tensor | None = None,
        start_from_position: int | None = None,
    ) -> torch.Tensor:
        """Run hidden states [B, T, H] of the next tokens through every block; returns [B, T, H]."""
        if self.closed or not self._opened:
            raise InvalidRequest("the inference session is closed or was never opened")
        position = self.position if start_from_position is None else start_from_position
        if not 0 <= position <= self.position:
            raise InvalidRequest(f"start_from_position={position} must lie in [0, {self.position}]")
        if position + hidden.shape[1] > self.max_length:
            raise InvalidRequest(
                f"{hidden.shape[1]} more tokens at position {position} exceed the session's "
                f"max_length={self.max_length}"
            )
        boundaries = []
        for span in self.spans:
            span_prompts = prompts[span.hop.start : span.hop.end] if prompts is not None else None
            hidden = await span.step(hidden, span_prompts, hypo_ids, start_from_position)
            boundaries.append(hidden)
        self.boundary_outputs = boundaries
        self.position = position + hidden.shape[1]
        return hidden

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        await asyncio.gather(*(span.close() for span in self.spans), return_exceptions=True)

    # --- synchronous facade ---------------------------------------------------------------------------------

    def open(self) -> InferenceSession:
        return self.runtime.run(self.aopen())

    def step(
        self,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None = None,
        hypo_ids: torch.Tensor | None = None,
        start_from_position: int | None = None,
    ) -> torch.Tensor:
        return self.runtime.run(self.astep(hidden, prompts, hypo_ids, start_from_position))

    def close(self) -> None:
        if not self.closed and self.runtime.loop.is_running():
            self.runtime.run(self.aclose())

    def __enter__(self) -> InferenceSession:
        return self if self._opened else self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> InferenceSession:
        return self if self._opened else await self.aopen()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
