"""The simulated internet: every peer is a point on a plane, and the round trip between two peers grows
with their distance, from the scenario's nearest to its farthest. Each peer has an upload rate: a token's
hidden state takes `hidden_bytes` over it. Peers behind home routers reach each other directly after a
hole punch (libp2p's DCUtR, which succeeds for a pair with the scenario's `hole_punch_success`), else
through the relay the called server holds a reservation on; a peer behind a router and a public one always
connect directly (the public one is dialled, or dials back). A relayed connection's round trip goes
through the relay, and its data through the relay's upload too.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass
class Peer:
    place: tuple[float, float]
    upload: float  # seconds a token's hidden state takes over its upload
    behind_nat: bool = False
    relay: str | None = None  # a server behind a router: the peer relaying connections to it


class Network:
    def __init__(
        self, rtt_ms: tuple[float, float], rng: random.Random, hidden_bytes: int = 0, punch: float = 1.0
    ):
        self.nearest = rtt_ms[0] / 1000
        self.farthest = rtt_ms[1] / 1000
        self._per_distance = (self.farthest - self.nearest) / math.sqrt(2)  # the plane's diagonal: farthest
        self.peers: dict[str, Peer] = {}
        self.hidden_bits = 8 * hidden_bytes
        self._punch = int(punch * 2**32)  # a pair's hole punch succeeds when its hash is below this
        self._rng = rng

    def place(
        self,
        peer_id: str,
        rng: random.Random | None = None,
        upload_mbps: float = 1000.0,
        behind_nat: bool = False,
    ) -> Peer:
        rng = rng or self._rng
        peer = Peer((rng.random(), rng.random()), self.hidden_bits / (upload_mbps * 1e6), behind_nat)
        self.peers[peer_id] = peer
        return peer

    def forget(self, peer_id: str) -> None:
        del self.peers[peer_id]

    def distance(self, a: str, b: str) -> float:
        """Seconds of a direct round trip between `a` and `b`."""
        here = self.peers[a].place
        there = self.peers[b].place
        return self.nearest + self._per_distance * math.hypot(here[0] - there[0], here[1] - there[1])

    def relay_of(self, caller: str, called: str) -> str | None:
        """The relay a connection from `caller` to `called` goes through (None: direct)."""
        other = self.peers[called]
        if not (self.peers[caller].behind_nat and other.behind_nat) or other.relay is None:
            return None
        pair = f"{min(caller, called)}|{max(caller, called)}".encode()
        return None if zlib.crc32(pair) < self._punch else other.relay

    def path(self, a: str, b: str) -> tuple[float, float]:
        """From `a` to `b`: seconds of a round trip, as a ping measures it, and seconds a token's hidden
        state takes (over the relay's upload too if relayed); the relay looked up once for both."""
        relay = self.relay_of(a, b)
        if relay is None:
            return self.distance(a, b), self.peers[a].upload
        rtt = self.distance(a, relay) + self.distance(relay, b)
        return rtt, self.peers[a].upload + self.peers[relay].upload

    def rtt(self, a: str, b: str) -> float:
        return self.path(a, b)[0]

    def transfer(self, a: str, b: str) -> float:
        return self.path(a, b)[1]

    def step_round_trip(self, client: str, server: str) -> float:
        """A decode step's true round trip between a client and a server, its data both ways included."""
        rtt, there = self.path(client, server)
        return rtt + there + self.transfer(server, client)

    def links(self) -> Mapping[str, Mapping[str, float]]:
        """Every server's true cost of pushing a step to every other, as routing reads announced round
        trips (it halves them): the round trip plus the data both ways (computed on demand: a thousand
        servers would make a million)."""
        return _Links(self)


class _Links(Mapping[str, Mapping[str, float]]):
    def __init__(self, network: Network):
        self.network = network

    def __getitem__(self, peer_id: str) -> Mapping[str, float]:
        if peer_id not in self.network.peers:
            raise KeyError(peer_id)
        return _Row(self.network, peer_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self.network.peers)

    def __len__(self) -> int:
        return len(self.network.peers)


class _Row(Mapping[str, float]):
    def __init__(self, network: Network, peer_id: str):
        self.network = network
        self.peer_id = peer_id

    def __getitem__(self, other: str) -> float:
        if other not in self.network.peers:
            raise KeyError(other)
        return self._cost(other)

    def get(self, other: str, default: float | None = None) -> float | None:  # routing's hot path
        return self._cost(other) if other in self.network.peers else default

    def _cost(self, other: str) -> float:
        rtt, transfer = self.network.path(self.peer_id, other)
        return rtt + 2 * transfer

    def __iter__(self) -> Iterator[str]:
        return iter(self.network.peers)

    def __len__(self) -> int:
        return len(self.network.peers)
