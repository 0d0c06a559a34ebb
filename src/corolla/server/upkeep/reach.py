"""How other peers reach a server, settled when it joins and kept true while it runs.

Behind NAT it takes relay reservations from right after joining, before its weights load, so it is
reachable by the time it serves (swarm/nat/reservations.py), and renews them every few seconds. Once it
serves it says in one line how it is reached; behind NAT, later changes of its relays are said too. Its
status (`corolla status`, the dashboard, its records) shows the same: direct, relayed (through which
relays, with their limits) or unreachable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from hivemind import DHT
from hivemind.p2p import P2P

from corolla.config import SwarmConfig
from corolla.server.upkeep.periodic import Periodic
from corolla.swarm.nat.reachability import describe_direct
from corolla.swarm.nat.reservations import RENEW_PERIOD, Reservations
from corolla.swarm.records.block_records import find_spans
from corolla.swarm.records.record_cells import position
from corolla.wire.records import RelayPath

logger = logging.getLogger(__name__)

RELAY_WAIT = 30.0  # seconds a server behind NAT waits for a relay before it says none took it


class Reach:
    def __init__(self, swarm: SwarmConfig, dialed_back: str):
        self.swarm = swarm
        self.dialed_back = dialed_back
        self.p2p: P2P | None = None
        self.reservations: Reservations | None = None
        # not behind NAT: direct when it said so or peers dialed it back ("": not checked)
        self.kind = "direct" if swarm.reachability == "public" or dialed_back == "direct" else ""
        self._loop: Periodic | None = None
        self._round_started = 0.0

    @property
    def behind_nat(self) -> bool:
        return self.swarm.reachability == "behind-nat"

    @property
    def reachability(self) -> str:
        return self.reservations.reachability if self.reservations is not None else self.kind

    @property
    def paths(self) -> tuple[RelayPath, ...]:
        return self.reservations.paths if self.reservations is not None else ()

    def start(
        self,
        p2p: P2P,
        find_public: Callable[[], Awaitable[Sequence[str]]],
        announce: Callable[[], Awaitable[object]],
    ) -> None:
        """Right after joining: behind NAT, reservations on relays begin; whenever its relays change, the
        server announces its new relayed addresses at once (`announce`), not at its next period."""
        self.p2p = p2p
        if self.behind_nat:
            self.reservations = Reservations(p2p, self.swarm.initial_peers, find_public)
            self.announce = announce
            failure = "Renewing the relay reservations failed"
            self._loop = Periodic("corolla-relays", self._renew, self._until_next, failure, at_once=True)
            self._loop.start()

    async def _renew(self) -> None:
        self._round_started = time.monotonic()
        if await self.reservations.renew():
            await self.announce()

    def _until_next(self) -> float:
        """Renewals come every RENEW_PERIOD however long a round took (they keep the router's flows)."""
        return max(0.5, RENEW_PERIOD - (time.monotonic() - self._round_started))

    async def report(self) -> None:
        """Once serving: say how other peers reach it (behind NAT: after up to RELAY_WAIT seconds for a
        relay), and from then on say when that changes."""
        if self.reservations is None:
            _, line = await describe_direct(self.p2p, self.swarm, self.dialed_back)
            logger.info(line)
            return
        await self.reservations.wait_for_one(RELAY_WAIT)
        self.reservations.speak()

    async def stop(self) -> None:
        if self._loop is not None:
            await self._loop.stop()


async def public_servers(dht: DHT, dht_prefix: str, num_blocks: int, peer_id: str) -> list[str]:
    """Servers of the model that its records (down this server's path) say are reached directly: they
    relay for peers behind NAT."""
    spans = await find_spans(dht, dht_prefix, num_blocks, where=position(peer_id))
    return [span.peer_id for span in spans if span.info.reachability == "direct"]
