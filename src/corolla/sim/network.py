"""The simulated internet: every peer is a point on a plane, and the round trip between two peers grows
with their distance, from the scenario's nearest to its farthest."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping


class Network:
    def __init__(self, rtt_ms: tuple[float, float], rng: random.Random):
        self.nearest = rtt_ms[0] / 1000
        self.farthest = rtt_ms[1] / 1000
        self._per_distance = (self.farthest - self.nearest) / math.sqrt(2)  # the plane's diagonal: farthest
        self.places: dict[str, tuple[float, float]] = {}
        self._rng = rng

    def place(self, peer_id: str, rng: random.Random | None = None) -> None:
        rng = rng or self._rng
        self.places[peer_id] = (rng.random(), rng.random())

    def rtt(self, a: str, b: str) -> float:
        """Seconds of a round trip between peers `a` and `b`."""
        here = self.places[a]
        there = self.places[b]
        return self.nearest + self._per_distance * math.hypot(here[0] - there[0], here[1] - there[1])

    def links(self) -> Mapping[str, Mapping[str, float]]:
        """Every server's round trip to every other, as push routing reads announced ones (computed on
        demand: a thousand servers would make a million)."""
        return _Links(self)


class _Links(Mapping[str, Mapping[str, float]]):
    def __init__(self, network: Network):
        self.network = network

    def __getitem__(self, peer_id: str) -> Mapping[str, float]:
        if peer_id not in self.network.places:
            raise KeyError(peer_id)
        return _Row(self.network, peer_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self.network.places)

    def __len__(self) -> int:
        return len(self.network.places)


class _Row(Mapping[str, float]):
    def __init__(self, network: Network, peer_id: str):
        self.network = network
        self.peer_id = peer_id

    def __getitem__(self, other: str) -> float:
        if other not in self.network.places:
            raise KeyError(other)
        return self.network.rtt(self.peer_id, other)

    def get(self, other: str, default: float | None = None) -> float | None:  # routing's hot path
        return self.network.rtt(self.peer_id, other) if other in self.network.places else default

    def __iter__(self) -> Iterator[str]:
        return iter(self.network.places)

    def __len__(self) -> int:
        return len(self.network.places)
