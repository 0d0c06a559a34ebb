"""The search behind swarm/policy/routing.py `choose_chain`: the cheapest chain over a range of blocks, by
dynamic programming from the last cut point back to the first, in time that grows about linearly with the
servers.

A hop on server s from cut p to cut q costs the step's way to s + (q - p) x per_block_s, where per_block_s
is s's compute per block stretched by its load, its cache and routing's jitter (a busy server computes
slower; the network is no slower for it). Only the way to s depends on the server before it (with push:
half the ping between the two), so at each cut the search keeps two tables, filled from the last cut back:
- `way[p, s]`: the cheapest way on from cut p whose first hop runs on s, but for getting the step to s.
  It is a running minimum per server over the cuts after p (each server's span is walked once);
- `best[p, previous]`: the cheapest way on from p for a step that comes from `previous` (None: from the
  client, and always without push).
With push, a link nobody announced is guessed as the mean of the client's round trips to both servers, so
which server is the cheapest to reach over a guessed link does not depend on the previous server: the
servers of a cut are sorted once by what they cost on from there over a guessed link, and each previous
server takes the first whose link it did not announce; the few announced links are tried one by one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

INF = float("inf")


@dataclass(frozen=True, slots=True, eq=False)
class Candidate:
    """A server as the search sees it."""

    peer_id: str
    start: int
    end: int
    rtt: float  # the client's round trip to it
    per_block: float  # its compute per block, stretched by its load and cache and routing's jitter


@dataclass(slots=True)
class _Cut:
    """What the search knows at one cut point once the cuts after it are done."""

    covering: dict[str, Candidate]  # peer id -> a server holding the block that starts here
    way: dict[str, tuple[float, int]]  # peer id -> (cost on from here through a first hop on it, its stop)
    guessed: list[tuple[float, Candidate]] | None = (
        None  # (way + a quarter of its round trip, server), sorted
    )


def cheapest(
    servers: Sequence[Candidate],
    start: int,
    cuts: Sequence[int],
    links: Mapping[str, Mapping[str, float]],
    push: bool,
) -> tuple[float, list[tuple[str, int, int]]]:
    """The cheapest chain's cost and hops (peer id, start, end) from `start` over `cuts` (sorted, the last
    one the end); the cost is infinite (and no hops) when no chain ends on allowed cuts."""
    end = cuts[-1]
    points = [start, *cuts]
    table = {p: _Cut({s.peer_id: s for s in servers if s.start <= p < s.end}, {}) for p in points[:-1]}
    ending = {q: [s for s in servers if s.start < q <= s.end] for q in cuts}
    running: dict[str, tuple[float, int]] = {}  # peer id -> least (q x per_block + best on from q, q)
    best: dict[tuple[int, str | None], tuple[float, Candidate | None]] = {}
    for p in reversed(points):
        if p < end:
            cut = table[p]
            for s in cut.covering.values():
                value, stop = running.get(s.peer_id, (INF, end))
                cut.way[s.peer_id] = (value - p * s.per_block, stop)
        for s in ending.get(p, []) if p > start else []:
            previous = s if push else None
            if (p, _id(previous)) not in best:
                best[p, _id(previous)] = _best(p, end, previous, table, links, push)
            value = p * s.per_block + best[p, _id(previous)][0]
            if value < running.get(s.peer_id, (INF, end))[0]:
                running[s.peer_id] = (value, p)
    best[start, None] = _best(start, end, None, table, links, push)
    return best[start, None][0], _hops(start, end, best, table, push)


def _id(candidate: Candidate | None) -> str | None:
    return candidate.peer_id if candidate is not None else None


def _best(
    p: int,
    end: int,
    previous: Candidate | None,
    table: Mapping[int, _Cut],
    links: Mapping[str, Mapping[str, float]],
    push: bool,
) -> tuple[float, Candidate | None]:
    """The cheapest way on from cut `p` for a step coming from `previous`, and the server it goes to."""
    if p == end:
        return (previous.rtt / 2 if push and previous is not None else 0.0), None
    cut = table[p]
    if previous is None:
        share = 0.5 if push else 1.0  # with push the client sends the step one way only
        return _least((s.rtt * share + cut.way[s.peer_id][0], s) for s in cut.covering.values())
    measured = links.get(previous.peer_id, {})
    if len(measured) > len(cut.covering):  # every link known (a simulation's oracle): try each server
        return _least((_to(previous, s, measured) + cut.way[s.peer_id][0], s) for s in cut.covering.values())
    announced = _least(
        (rtt / 2 + cut.way[s.peer_id][0], s)
        for peer_id, rtt in measured.items()
        if (s := cut.covering.get(peer_id)) is not None
    )
    if cut.guessed is None:  # a guessed link costs (previous's round trip + s's) / 4
        cut.guessed = sorted(
            ((s.rtt / 4 + cut.way[s.peer_id][0], s) for s in cut.covering.values()), key=lambda x: x[0]
        )
    guessed = next(
        ((previous.rtt / 4 + g, s) for g, s in cut.guessed if s.peer_id not in measured), (INF, None)
    )
    return announced if announced[0] <= guessed[0] else guessed


def _to(previous: Candidate, s: Candidate, measured: Mapping[str, float]) -> float:
    """Half the ping from `previous` to `s`: announced, or guessed from the client's round trips to both."""
    return measured.get(s.peer_id, (previous.rtt + s.rtt) / 2) / 2


def _least(options) -> tuple[float, Candidate | None]:
    return min(options, key=lambda option: option[0], default=(INF, None))


def _hops(start: int, end: int, best, table: Mapping[int, _Cut], push: bool) -> list[tuple[str, int, int]]:
    hops = []
    p = start
    previous = None
    while p < end:
        cost, s = best[p, previous]
        if s is None or cost == INF:
            return []
        stop = table[p].way[s.peer_id][1]
        hops.append((s.peer_id, p, stop))
        p = stop
        previous = s.peer_id if push else None
    return hops
