"""The servers' records as the simulated DHT holds them, kept up to date one change at a time (a thousand
servers announcing every period must not rebuild anything).

Two views, as in the real swarm: what clients read (every unexpired record; they ping the servers anyway)
and what placement counts (records renewed lately: swarm/dht.py `placed_servers`). In the simulation
every live server renews on time, so a record stops counting for placement only when its server crashed:
`went_stale` is called then, at the moment wire/records.py `missed_renewal` says so, and `expire` when the
record is gone for clients too. Placement's coverage (throughput per block) and replicas are kept as they
change.
"""

from __future__ import annotations

from dataclasses import dataclass

from corolla.swarm.policy.placement import Placed


@dataclass
class Record:
    placed: Placed
    announced_at: float
    expires: float


class RecordBook:
    def __init__(self, num_blocks: int):
        self.records: dict[str, Record] = {}
        self.view: dict[str, Placed] = {}  # what clients read
        self.placed: dict[str, Placed] = {}  # what placement counts
        self.starting: dict[int, set[str]] = {}  # block -> peer ids of `placed` spans starting there
        self.cover = [0.0] * num_blocks  # coverage of `placed`, as placement.coverage computes it
        self.held = [0.0] * num_blocks  # and its replicas (placement.replicas)
        self.version = 0  # grows whenever `placed` changes

    def store(self, peer_id: str, record: Record) -> None:
        """A server announced (or moved): its record is renewed."""
        old = self.records.get(peer_id)
        self.records[peer_id] = record
        if old is not None and old.placed == record.placed and peer_id in self.placed:
            return
        self.view[peer_id] = record.placed
        self._uncount(peer_id)
        self.placed[peer_id] = record.placed
        self.starting.setdefault(record.placed[0], set()).add(peer_id)
        self._add(record.placed, 1.0)
        self.version += 1

    def went_stale(self, peer_id: str) -> None:
        """Its server missed renewing it: placement stops counting it."""
        if self._uncount(peer_id):
            self.version += 1

    def expire(self, peer_id: str, now: float) -> None:
        """Gone from the DHT, unless renewed since."""
        record = self.records.get(peer_id)
        if record is not None and record.expires <= now:
            del self.records[peer_id]
            del self.view[peer_id]
            self.went_stale(peer_id)

    def withdraw(self, peer_id: str) -> None:
        """Its server announced OFFLINE: nobody reads it as serving any more."""
        if self.records.pop(peer_id, None) is not None:
            del self.view[peer_id]
            self.went_stale(peer_id)

    def has_hole(self) -> bool:
        """Whether some block has no server placement counts (a tolerance for the sums' rounding)."""
        return min(self.cover) <= 1e-9

    def _uncount(self, peer_id: str) -> bool:
        placed = self.placed.pop(peer_id, None)
        if placed is None:
            return False
        self.starting[placed[0]].discard(peer_id)
        self._add(placed, -1.0)
        return True

    def _add(self, placed: Placed, sign: float) -> None:
        start, end, weight = placed[:3]
        for index in range(max(start, 0), min(end, len(self.cover))):
            self.cover[index] += sign * weight
            self.held[index] += sign
