"""Speeds a peer cannot inflate far: each announced speed bounded by what its device does for the others.

A server announces its own speed (its start-up figure, then the pace of its passes: wire/records.py
`ServerStatus.speed`), and routing believes it until the client has timed the server itself. A peer may
announce anything: one announcing 100 times its speed draws the first sessions of every client (corolla sim
`liars`). Servers also announce their device (`device_name`, e.g. "NVIDIA GeForce RTX 3060") and their
weights' precision, and servers of one device and precision are about as fast: so an announced speed counts
for at most DEVICE_MARGIN times the median of those announced for its device and precision, where at least
MIN_PEERS servers announce that pair. A liar is then believed to be at most an ordinary one of its kind;
the price: an honest server faster than its device's median is believed to be the median until a client
times it (corolla sim `liars`, and the same with the liars among RTX 4090s: sessions' latency against the
oracle 1.05x / 1.27x and 1.04x / 1.28x median / p95 with the bound, 1.08x / 1.27x and 1.11x / 1.91x
without; with twice the median, 1.06x / 1.28x and 1.05x / 1.77x).

A speed of IMPLAUSIBLE times its device's median or more is no measurement but a lie (honest servers of
one device differ by tens of percent, and by up to 3.8x where some still announce a start-up figure taken
while others started on the same machine: three SmolLM2 servers started together measured 121-154
blocks/s, then 465-482 idle and 445-461 as they served), and counts for the slowest speed announced for
that device: a liar is believed to be the worst of its kind, routing's last choice among them until a
client times it, and honest servers choosing their level in the records' tree do not count it as faster
(corolla sim, the liars among RTX 4090s: sessions' latency against the oracle 1.04x / 1.20x median / p95
against 1.04x / 1.28x with the median's bound alone).

The blocks' keys keep the fastest servers as each server reads them when it chooses its level
(swarm/records/record_cells.py): those speeds are bounded the same way (swarm/records/block_records.py), and
a server counts none of `implausible` speed as faster than itself, so honest servers do not leave the keys
for liars; a liar writes itself into them as it likes and keeps its places there, so a key holding such
records makes room for HONEST_PER_DOUBTED honest servers per liar (record_cells.Walk.room): with the liars
among RTX 4090s, 83.4% of the places honest (76.4% before, 77.0% without the room).

A server naming a device fewer than MIN_PEERS servers announce (or none) counts for at most RARE_MARGIN
times the median of the fastest device enough servers announce: a liar naming a device of its own is
believed to be at most twice as fast as the swarm's fastest kind, and an honest server of a rare device
(a newer GPU) keeps up to that much of its lead until a client times it. Not caught: many liars naming
one device (their median is a lie). Clients' own timings (client/routing/estimates.py `observed`) still
override announcements once they have them.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping

from corolla.wire.records import ServerStatus

DEVICE_MARGIN = 1.0  # a server counts for at most this times the median of its device's
MIN_PEERS = 3  # servers announcing a device and precision before their median bounds them
RARE_MARGIN = 2.0  # a device too few servers announce counts for at most this times the fastest kind's median
IMPLAUSIBLE = 5.0  # a speed this many times its device's median is a lie: it counts for the slowest one's


def announced_kinds(statuses: Mapping[str, ServerStatus]) -> list[tuple[str, Hashable, float | None]]:
    """(peer id, its device and precision or None, its announced speed) of each record."""
    return [
        (peer_id, (status.device_name, status.precision) if status.device_name else None, status.speed)
        for peer_id, status in statuses.items()
    ]


def speed_bounds(statuses: Mapping[str, ServerStatus]) -> dict[str, float]:
    """For each server whose device and precision MIN_PEERS servers announce (with a speed), the most
    its announced speed counts for."""
    return device_bounds(announced_kinds(statuses))


def bounded(speeds: Mapping[str, float], bounds: Mapping[str, float]) -> dict[str, float]:
    """`speeds` with each one that has a bound held to it."""
    return {peer: min(speed, bounds.get(peer, speed)) for peer, speed in speeds.items()}


def device_bounds(announced: Iterable[tuple[str, Hashable, float | None]]) -> dict[str, float]:
    """`speed_bounds` over (peer id, its device and precision (None: it names none), its announced speed)
    triples."""
    announced = list(announced)
    judged = _judged(announced)
    fastest = max((median for median, _ in judged.values()), default=None)
    bounds = {}
    for peer_id, kind, speed in announced:
        if kind in judged:
            median, slowest = judged[kind]
            bounds[peer_id] = slowest if _lies(speed, median) else DEVICE_MARGIN * median
        elif fastest is not None:  # a device too few announce (or none named): see RARE_MARGIN
            bounds[peer_id] = RARE_MARGIN * fastest
    return bounds


def implausible(announced: Iterable[tuple[str, Hashable, float | None]]) -> set[str]:
    """Of (peer id, device and precision, announced speed) triples, the peers announcing IMPLAUSIBLE times
    their device's median or more: a server choosing its level in the records' tree counts none of them
    as faster than itself (a liar's real speed is unknown: it must not push honest servers out of the
    blocks' keys, where it writes itself anyway)."""
    announced = list(announced)
    judged = _judged(announced)
    return {peer for peer, kind, speed in announced if kind in judged and _lies(speed, judged[kind][0])}


def _judged(announced: list[tuple[str, Hashable, float | None]]) -> dict[Hashable, tuple[float, float]]:
    """The median and the slowest speed of each device and precision that MIN_PEERS servers announce."""
    speeds: dict[Hashable, list[float]] = defaultdict(list)
    for _, kind, speed in announced:
        if speed:
            speeds[kind].append(speed)
    return {
        kind: (statistics.median(v), min(v))
        for kind, v in speeds.items()
        if len(v) >= MIN_PEERS and kind is not None
    }


def _lies(speed: float | None, median: float) -> bool:
    return speed is not None and speed >= IMPLAUSIBLE * median
