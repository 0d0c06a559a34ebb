"""Periodic DHT announcements of a server's status (server/status.py) under every block it hosts (in
its cell of each block's records tree: swarm/records/record_cells.py, the level its links' walk chose).

Records are signed with the server's identity (swarm/dht.py). They expire after 2.5 announce periods,
so a server that dies without a word disappears from clients' views on its own; a server that stops
gracefully announces OFFLINE first. Each record says when it was stored and how often it is renewed, so
placement and rebalancing stop counting a dead server's records after 1.5 periods
(wire/records.py STALE_PERIODS), long before they expire. The model itself is listed under the models
key by a few of its servers only (swarm/records/model_listing.py), so that key stays small however large
the swarm.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from hivemind.utils import get_dht_time

from corolla.server.upkeep.periodic import Periodic
from corolla.swarm.dht import PeerDHT, announce_model
from corolla.swarm.records.block_records import announce
from corolla.swarm.records.record_cells import Place
from corolla.wire.records import RECORD_LIFETIME, ServerState, ServerStatus

logger = logging.getLogger(__name__)


class Announcer:
    def __init__(
        self,
        dht: PeerDHT,
        dht_prefix: str,
        period: float,
        snapshot: Callable[[], ServerStatus],
        num_blocks: int,
        lists_model: Callable[[], bool] = lambda: True,
        place: Place | None = None,
    ):
        self.dht = dht
        self.dht_prefix = dht_prefix
        self.period = period
        self.num_blocks = num_blocks  # the model's: listed under the swarm's models key while ONLINE
        self.snapshot = snapshot
        self.lists_model = lists_model  # whether this server is one of those listing the model (swarm/dht.py)
        self.place = place or Place(0)  # where in the records' tree (swarm/records/record_cells.py)
        self.leaving: range = range(0)  # blocks this server is moving away from (their records are replaced)
        self._loop = Periodic(
            "corolla-announcer", self.announce, lambda: self.period, "Announcement failed; retrying"
        )

    @property
    def expiration(self) -> float:
        return RECORD_LIFETIME * self.period

    async def announce(self) -> bool:
        record = replace(self.snapshot(), announced_at=get_dht_time(), announce_period=self.period)
        place = self.place
        ok = await announce(
            self.dht, self.dht_prefix, record, self.expiration, self.leaving, place.level or 0, place.where
        )
        if record.state == ServerState.ONLINE and self.lists_model():
            ok &= await announce_model(self.dht, self.dht_prefix, self.num_blocks, self.expiration)
        if not ok:
            logger.warning(
                "Could not store the %s announcement for blocks %d:%d on the DHT",
                record.state.name,
                record.start,
                record.end,
            )
        return ok

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()
