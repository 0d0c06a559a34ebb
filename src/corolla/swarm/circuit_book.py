"""Where to dial servers behind NAT: the relayed addresses their signed records announce.

A server behind NAT is reached only through the relays it holds reservations on (swarm/reservations.py),
and the libp2p daemon does not learn those addresses by itself (it would look for them in libp2p's DHT,
where they are not). Every record a peer reads (swarm/block_records.py, a ping's reply) passes its
server's relay paths here, and the transport connects through them before it opens a stream or calls
that server (swarm/transport.py). A path is a relay's address as the server's signed record gives it; the
daemon dials the relay and asks it for a circuit to that server, nothing else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from hivemind.p2p import P2P, PeerID

from corolla.swarm.circuit_v2 import Address
from corolla.wire.records import RelayPath

logger = logging.getLogger(__name__)

MAX_PEERS = 4096  # servers remembered (the oldest forgotten first)
CONNECT_TIMEOUT = 10.0


class CircuitBook:
    def __init__(self) -> None:
        self._paths: dict[str, tuple[RelayPath, ...]] = {}
        self.connected_at: dict[str, float] = {}  # peer -> when a connect through its relays last succeeded

    def learn(self, peer_id: str, paths: Sequence[RelayPath]) -> None:
        """What a server's newest record (or ping reply) says of its relays (none: reached directly)."""
        self._paths.pop(peer_id, None)
        if paths:
            self._paths[peer_id] = tuple(paths)
            while len(self._paths) > MAX_PEERS:
                self._paths.pop(next(iter(self._paths)))

    def paths(self, peer_id: str) -> tuple[RelayPath, ...]:
        return self._paths.get(peer_id, ())

    async def reach(self, p2p: P2P, peer_id: str) -> None:
        """Connect to a server behind NAT through its relays (a no-op while connected, or for a server
        reached directly); a failure is left to the call that follows, which then fails as it would."""
        paths = self._paths.get(peer_id)
        if not paths:
            return
        addresses = [Address(path.address) for path in paths]
        try:
            await p2p._client.connect(PeerID.from_base58(peer_id), addresses)
        except Exception as e:  # the relays are gone or refuse: the call says so
            logger.debug("Could not connect to ...%s through its relays: %s", peer_id[-6:], e)
            return
        self.connected_at.setdefault(peer_id, time.monotonic())

    def lost(self, peer_id: str) -> None:
        """The connection to `peer_id` broke: the next connect is a new one."""
        self.connected_at.pop(peer_id, None)


BOOK = CircuitBook()  # one per process: what the records it read said
