"""Rebalancing: a self-placed server moves to other blocks when that clearly helps the swarm.

Every balance period (with jitter, so servers do not read the DHT in step) the server reads every
server's span and throughput; all servers compute every server's best move from the same view, and only
the one whose move helps most makes it (swarm/policy/placement.py: `my_move`), so two servers never rush into
the same hole. The links monitor reads the same view every announce period (server/upkeep/link_monitor.py);
when it shows a block without a server, the check runs at once on that view (`look`), not a balance period
later (corolla sim: a crash that left blocks without a server was repaired 3 announce periods later before).
The move itself belongs to the hosted spans (server/hosting/spans.py).
"""

from __future__ import annotations

import asyncio
import random

from hivemind import DHT

from corolla.server.hosting.spans import HostedSpans
from corolla.server.inference.service import InferenceService
from corolla.server.upkeep.announcer import Announcer
from corolla.server.upkeep.periodic import Periodic
from corolla.swarm.policy.placement import Placed, coverage, my_move
from corolla.swarm.records.block_records import KeptPath, placed_servers


class Rebalancer:
    def __init__(
        self,
        dht: DHT,
        spans: HostedSpans,
        inference: InferenceService,
        announcer: Announcer,
        peer_id: str,
        num_blocks: int,
        throughput: float,
        period: float,
    ):
        self.dht = dht
        self.spans = spans
        self.inference = inference
        self.announcer = announcer
        self.peer_id = peer_id
        self.num_blocks = num_blocks
        self.throughput = throughput  # as measured at start: every server weighs it by that figure
        self.kept: KeptPath | None = None  # its path as the server's links keep it (reused in large swarms)
        # the jitter spreads the servers' DHT reads; a failed check or move is retried at the next period
        jittered = lambda: period * random.uniform(0.8, 1.2)  # noqa: E731
        self._loop = Periodic("corolla-balancer", self.check, jittered, "Rebalancing failed")
        self._checking = asyncio.Lock()  # a look and the periodic check never decide (and move) at once

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def look(self, servers: dict[str, Placed]) -> tuple[int, int] | None:
        """Another part's fresh read of every server's span (a copy, this check's to change): checked at
        once if some block has none."""
        if min(coverage(servers.values(), self.num_blocks)) > 0:
            return None
        return await self.check(servers)

    async def check(self, servers: dict[str, Placed] | None = None) -> tuple[int, int] | None:
        """Move if this server is the one to move now (read the swarm unless `servers` is a fresh read);
        returns the blocks it moved to."""
        async with self._checking:
            return await self._check(servers)

    async def _check(self, servers: dict[str, Placed] | None) -> tuple[int, int] | None:
        if self.spans.is_moving or self.inference.draining:
            return None
        if servers is None:
            me = self.peer_id
            servers = await placed_servers(self.dht, self.spans.dht_prefix, self.num_blocks, me, self.kept)
        servers[self.peer_id] = (*self.spans.primary.blocks, self.throughput)
        # where no span may start or end: inside Gemma's layers that share keys and values
        forbidden = self.spans.primary.span.config.kv_sharing.forbidden_cuts
        target = my_move(servers, self.peer_id, self.num_blocks, forbidden)
        if target is None:
            return None
        old = await self.spans.move_to(target)
        self.announcer.leaving = range(*old.blocks)  # our records there now point clients elsewhere
        await self.announcer.announce()
        return target
