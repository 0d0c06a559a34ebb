"""Round trips to the servers that can take this server's outputs, for push-aware routing.

Every announce period the server reads the swarm from the DHT (down its own path of the records' tree,
which also settles the level it announces at: swarm/records/record_cells.py), pings (rpc_info) up to MAX_LINKS
servers whose spans start where its own ends, and keeps the round trips; the announcement carries them, so a
client can cost a chain's server-to-server hops without measuring them itself. While some block has at
most three servers it also pings up to MAX_CHECKED servers of the blocks with the fewest
(placement.weakest_holders): a server that crashed silently keeps its records for more than an announce
period, and a block it left bare would stay bare that long. The read, less the servers that did not answer
those pings, is passed to `on_read` (the rebalancer's look for blocks without a server), so nothing else
reads it again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from hivemind import DHT
from hivemind.p2p import P2P

from corolla.server.hosting.spans import HostedSpans
from corolla.server.upkeep.periodic import Periodic
from corolla.swarm.p2p.ping import ping
from corolla.swarm.p2p.transport import P2PTransport
from corolla.swarm.policy.placement import Placed, weakest_holders
from corolla.swarm.records.block_records import KeptPath, SwarmRead, placed, read_swarm
from corolla.swarm.records.record_cells import Place, position

logger = logging.getLogger(__name__)

MAX_LINKS = 8
MAX_CHECKED = 16  # servers of the weakest blocks pinged per read besides the next ones
PING_TIMEOUT = 2.0


class LinkMonitor:
    def __init__(
        self,
        dht: DHT,
        p2p: P2P,
        spans: HostedSpans,
        peer_id: str,
        num_blocks: int,
        period: float,
        speed: Callable[[], float],
    ):
        self.dht = dht
        self.p2p = p2p
        self.spans = spans
        self.peer_id = peer_id
        self.num_blocks = num_blocks
        self.period = period
        self.speed = speed  # as announced now: the blocks' keys keep the fastest
        self.pings: dict[str, float] = {}  # peer id -> seconds; on a failed round, the last figures stay
        self.on_read: Callable[[dict[str, Placed]], Awaitable[object]] | None = None
        self.seen: frozenset[str] = frozenset()  # the servers of the last read (peer ids)
        self.place = Place(position(peer_id))  # the walk is down this server's own path
        self.kept = KeptPath()  # its reads of its own path, reused in a large swarm (the rebalancer's too)
        failure = "Measuring the links to the next servers failed"
        self._loop = Periodic(
            "corolla-links", self.measure, lambda: period, failure, at_once=True, level=logging.DEBUG
        )

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def settle(self) -> SwarmRead:
        """Read down this server's own path and settle the level of its next announcement (called once
        before its first: a thousand servers joining at once would otherwise all announce at level 0)."""
        start, end = self.spans.primary.blocks
        where = self.place.where
        read = await read_swarm(self.dht, self.spans.dht_prefix, self.num_blocks, where, kept=self.kept)
        self.place.update(read.walk, range(start, end), self.peer_id, self.speed())
        return read

    async def place_first(self) -> None:
        """`settle` before the first announcement; if the read fails, that one goes to level 0."""
        try:
            await self.settle()
        except Exception:
            logger.warning("Could not read the swarm before announcing: announcing at level 0", exc_info=True)

    async def measure(self) -> None:
        end = self.spans.primary.blocks[1]
        read = await self.settle()
        servers = placed(read)
        self.seen = frozenset(servers)
        others = {peer: span for peer, span in servers.items() if peer != self.peer_id}
        nexts = [peer for peer, (first, stop, *_) in others.items() if first <= end < stop][:MAX_LINKS]
        # the servers a block would fall short without: pinged, not trusted (records outlive their servers)
        weakest = [
            peer for peer in weakest_holders(others, self.num_blocks, MAX_CHECKED) if peer not in nexts
        ]
        transport = P2PTransport(self.p2p)
        pinged = [*nexts, *weakest]
        found = await asyncio.gather(*(ping(transport, peer, PING_TIMEOUT) for peer in pinged))
        answers = dict(zip(pinged, found, strict=True))
        self.pings = {peer: answers[peer].seconds for peer in nexts if answers[peer].answered}
        silent = {peer for peer in weakest if not answers[peer].answered}
        if silent:
            names = ", ".join(f"...{peer[-6:]}" for peer in sorted(silent))
            logger.info(f"Servers {names} did not answer: their blocks are counted without them")
        if self.on_read is not None:  # what answers: a block a silent crash left bare is seen at once
            await self.on_read({peer: span for peer, span in servers.items() if peer not in silent})
