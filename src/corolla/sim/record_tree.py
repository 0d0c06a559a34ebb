"""The servers' records tree (swarm/records/record_cells.py) held in memory: servers announce by its own rules
(`Place.update` after a `Walk` down their path) and readers walk it, as the real peers do over the DHT.
For sim/dht.py, which prices those reads and stores on hivemind's Kademlia code, and for the simulated
swarm, whose clients route over what their read finds (sim/clients.py)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from corolla.swarm.policy.plausible import bounded, device_bounds, implausible
from corolla.swarm.records.record_cells import Place, Walk, position


class RecordTree:
    def __init__(self, dht_prefix: str, num_blocks: int):
        self.dht_prefix = dht_prefix
        self.num_blocks = num_blocks
        self.cells: dict[str, set[str]] = {}  # key -> peer ids stored there
        self.places: dict[str, Place] = {}
        self.blocks: dict[str, range] = {}
        self.speeds: dict[str, float] = {}  # announced throughputs
        self.devices: dict[str, str] = {}  # announced devices
        self._stored: dict[str, list[str]] = {}

    def walk(self, where: int | None, budget: int | None = None, rng: random.Random | None = None) -> Walk:
        """A reader's walk down the path `where` (None: every path, `budget` cells at most, then a path
        `rng` draws), every level read in one go."""
        walk = Walk(self.dht_prefix, self.num_blocks, where, budget, rng=rng)
        seen: dict[str, float] = {}
        while not walk.done:
            keys = walk.keys()
            found = {cell: sorted(self.cells.get(key, ())) for key, cell in keys.items()}
            seen.update({peer: self.speeds[peer] for peers in found.values() for peer in peers})
            # announced speeds bounded by their devices' as swarm/records/block_records.py bounds them
            kinds = [(peer, self.devices[peer], s) for peer, s in seen.items() if peer in self.devices]
            walk.add(found, bounded(seen, device_bounds(kinds)), implausible(kinds))
        return walk

    def announce(
        self, peer: str, blocks: range, rng: random.Random, throughput: float = 1.0, device: str | None = None
    ) -> list[str]:
        """`peer` walks its own path, settles its level and stores its record in its cell of each of
        `blocks` (its records at another level are gone: they expire in the real DHT); returns the keys."""
        place = self.places.setdefault(peer, Place(position(peer)))
        self.blocks[peer] = blocks
        self.speeds[peer] = throughput
        if device is not None:
            self.devices[peer] = device
        place.update(self.walk(place.where), blocks, peer, throughput, rng)
        keys = place.keys(self.dht_prefix, blocks)
        for key in self._stored.get(peer, ()):
            self.cells[key].discard(peer)
        for key in keys:
            self.cells.setdefault(key, set()).add(peer)
        self._stored[peer] = keys
        return keys

    def remove(self, peer: str) -> None:
        """`peer`'s records are gone (expired, or overwritten as OFFLINE)."""
        for key in self._stored.pop(peer, ()):
            self.cells[key].discard(peer)
        self.places.pop(peer, None)
        self.blocks.pop(peer, None)
        self.speeds.pop(peer, None)
        self.devices.pop(peer, None)

    def keys_of(self, peer: str) -> list[str]:
        """The keys `peer`'s records are stored under now."""
        return self._stored[peer]

    @classmethod
    def settled(
        cls,
        dht_prefix: str,
        num_blocks: int,
        spans: Sequence[range],
        rounds: int,
        rng: random.Random,
        speeds: Sequence[float] | None = None,
    ) -> RecordTree:
        """Servers `peer0`, `peer1`, ... with `spans` (and throughputs `speeds`, else 1.0) join one by
        one, then all announce `rounds` times more, in a random order each time."""
        tree = cls(dht_prefix, num_blocks)
        peers = [f"peer{i}" for i in range(len(spans))]
        for i, (peer, blocks) in enumerate(zip(peers, spans, strict=True)):
            tree.announce(peer, blocks, rng, 1.0 if speeds is None else speeds[i])
        for _ in range(rounds):
            for peer in rng.sample(peers, len(peers)):
                tree.announce(peer, tree.blocks[peer], rng, tree.speeds[peer])
        return tree


def seen(walk: Walk) -> dict[str, int]:
    """The peers a walk found, with the level each was found at."""
    return {
        peer: level for level, found in enumerate(walk.found) for peers in found.values() for peer in peers
    }
