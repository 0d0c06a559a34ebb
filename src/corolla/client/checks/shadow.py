"""Shadow chains for spot checks: a checked hop's inputs fed, check by check, to a chain of other servers.

A shadow is a chain over the checked hop's blocks on other servers (never the checked one), opened at
the hop's first check. Each check sends it only what it has not seen (its own cache holds the rest), so
checking a hop costs the checkers one pass over each position once, in chunks, instead of the whole
history at every check. When the checked session goes back (a rewind), the shadow goes back with it
(servers roll back to the position a step names).
"""

from __future__ import annotations

import torch

from corolla.client.chain.chain import Chain
from corolla.client.chain.opening import ChainSpec, Link
from corolla.client.routing.swarm_access import SwarmAccess


class Shadow:
    def __init__(self, chain: Chain):
        self.chain = chain
        self.position = 0  # positions fed so far

    @classmethod
    async def open(cls, swarm: SwarmAccess, checked: Link, max_length: int) -> Shadow:
        """A shadow of `checked` on servers other than its own; MissingBlocks if there is no such chain
        now (it does not wait for one)."""
        spec = ChainSpec(max_length, avoid=frozenset({checked.hop.peer_id}), wait=False)
        chain = Chain(swarm, spec)
        return cls(await chain.open(checked.hop.start, checked.hop.end))

    @property
    def peers(self) -> list[str]:
        return [hop.peer_id for hop in self.chain.route]

    async def outputs(self, inputs: torch.Tensor, start: int) -> torch.Tensor:
        """Its outputs [B, T - start, H] for positions [start, T) of `inputs` [B, T, H]; sends the positions
        it lacks (from `start`, or from where it stopped if that is earlier)."""
        begin = min(self.position, start)
        outputs = await self.chain.feed(inputs, begin)
        self.position = inputs.shape[1]
        return outputs[:, start - begin :]

    async def close(self) -> None:
        await self.chain.close()
