"""Where to dial servers behind NAT: the relayed addresses their signed records announce.

A server behind NAT is reached only through the relays it holds reservations on (swarm/nat/reservations.py),
and the libp2p daemon does not learn those addresses by itself (it would look for them in libp2p's DHT,
where they are not). Every record a peer reads (swarm/records/block_records.py, a ping's reply) passes its
server's relay paths here, and the transport connects through them before it opens a stream or calls
that server (swarm/p2p/transport.py). A path is a relay's address as the server's signed record gives it; the
daemon dials the relay and asks it for a circuit to that server, nothing else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from hivemind.p2p import P2P, PeerID

from corolla.swarm.nat.circuit_v2 import Address
from corolla.wire.records import RelayPath

logger = logging.getLogger(__name__)

MAX_PEERS = 4096  # servers remembered (the oldest forgotten first)
# a relayed connection is moved before it is this close to a relay's time limit (or this share of its
# data limit): a step must be answered before the relay cuts the connection
TIME_MARGIN = 10.0
TIME_MARGIN_SHARE = 0.05
DATA_SHARE = 0.9


class CircuitBook:
    def __init__(self, clock=time.monotonic) -> None:
        self._paths: dict[str, tuple[RelayPath, ...]] = {}
        self.clock = clock
        self.connected_at: dict[str, float] = {}  # peer -> when a connect through its relays first succeeded
        self.traffic: dict[str, list[int]] = {}  # peer -> [bytes sent, bytes received] since then

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
        if peer_id not in self.connected_at:
            self.connected_at[peer_id] = self.clock()
            self.traffic[peer_id] = [0, 0]

    def count(self, peer_id: str, sent: int, received: int) -> None:
        """Bytes of messages sent to and received from `peer_id` on its streams."""
        if (counts := self.traffic.get(peer_id)) is not None:
            counts[0] += sent
            counts[1] += received

    def lost(self, peer_id: str) -> None:
        """The connection to `peer_id` broke: the next connect is a new one."""
        self.connected_at.pop(peer_id, None)
        self.traffic.pop(peer_id, None)

    async def limit_ahead(self, p2p: P2P, peer_id: str, nbytes: int) -> str | None:
        """Whether sending `nbytes` more to `peer_id` now would come too close to a limit of the relay
        between us (its time, or its data each way), and if so why: the connection is then closed, so
        that the next stream makes a new one, with fresh limits. None for a server reached directly, or
        whose relayed connection turned direct (libp2p's hole punching)."""
        paths = self._paths.get(peer_id)
        opened = self.connected_at.get(peer_id)
        if not paths or opened is None:
            return None
        reason = self._near(paths, self.clock() - opened, max(self.traffic[peer_id]) + nbytes)
        if reason is None:
            return None
        for peer in await p2p.list_peers():
            if str(peer.peer_id) == peer_id and any("/p2p-circuit" not in str(a) for a in peer.addrs):
                self.lost(peer_id)  # direct now: no relay's limit applies (looked at again a limit later)
                return None
        await p2p._client.disconnect(PeerID.from_base58(peer_id))
        self.lost(peer_id)
        return reason

    @staticmethod
    def _near(paths: Sequence[RelayPath], age: float, data: int) -> str | None:
        time_limit = min((p.time_limit for p in paths if p.time_limit), default=None)
        data_limit = min((p.data_limit for p in paths if p.data_limit), default=None)
        if time_limit and age >= time_limit - max(TIME_MARGIN, TIME_MARGIN_SHARE * time_limit):
            return f"its relayed connection is {age:.0f} s old, the relay's limit is {time_limit} s"
        if data_limit and data >= DATA_SHARE * data_limit:
            return f"{data} bytes on its relayed connection, the relay's limit is {data_limit} each way"
        return None


BOOK = CircuitBook()  # one per process: what the records it read said
