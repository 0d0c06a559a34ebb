"""Shadow chains for spot checks: a checked hop's inputs fed, check by check, to a session on other servers.

A shadow is an inference session over the checked hop's blocks on a chain of other servers, opened at
the hop's first check. Each check sends it only what it has not seen (its own cache holds the rest), so
checking a hop costs the checkers one pass over each position once, in chunks, instead of the whole
history at every check. When the checked session goes back (a rewind), the shadow goes back with it
(servers roll back to the position a step names).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import torch

from corolla.client.span_session import REPLAY_CHUNK, SpanSession
from corolla.client.swarm import RETRYABLE
from corolla.errors import MissingBlocks

if TYPE_CHECKING:
    from corolla.client.swarm import SwarmClient


class Shadow:
    def __init__(self, spans: list[SpanSession]):
        self.spans, self.position = spans, 0  # positions fed so far

    @property
    def peers(self) -> list[str]:
        return [span.hop.peer_id for span in self.spans]

    async def outputs(self, inputs: torch.Tensor, start: int) -> torch.Tensor:
        """Its outputs [B, T - start, H] for positions [start, T) of `inputs` [B, T, H]; sends the positions
        it lacks (from `start`, or from where it stopped if that is earlier)."""
        begin = min(self.position, start)
        hidden = inputs[:, begin:]
        for span in self.spans:
            chunks = []
            for offset in range(0, hidden.shape[1], REPLAY_CHUNK):
                chunk = hidden[:, offset : offset + REPLAY_CHUNK]
                chunks.append(await span.step(chunk, None, None, begin + offset))
            hidden = torch.cat(chunks, dim=1)
        self.position = inputs.shape[1]
        return hidden[:, start - begin :]

    async def close(self) -> None:
        await asyncio.gather(*(span.close() for span in self.spans), return_exceptions=True)


async def open_shadow(swarm: SwarmClient, checked: SpanSession) -> Shadow | None:
    """A shadow of `checked` on servers other than its own, or None if there is no such chain now."""
    hop = checked.hop
    try:
        hops = await swarm.route(
            hop.start, hop.end, checked.max_length, checked.max_length, avoid={hop.peer_id}, wait=False
        )
    except MissingBlocks:
        return None
    spans = [
        SpanSession(
            swarm.p2p,
            link,
            swarm.dht_prefix,
            checked.max_length,
            swarm.config.request_timeout,
            active_adapter=swarm.config.active_adapter,
        )
        for link in hops
    ]
    results = await asyncio.gather(*(span.open() for span in spans), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        await Shadow(spans).close()
        if not all(isinstance(r, RETRYABLE) for r in failed):
            raise failed[0]
        return None
    return Shadow(spans)
