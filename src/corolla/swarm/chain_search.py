"""The search behind swarm/routing.py `choose_chain`: the cheapest chain over a range of blocks, by dynamic
programming from the last cut point back to the first, in time that grows about linearly with the servers.

A hop on server s from cut p to cut q costs (the step's way to s) x f_s + (q - p) x per_block_s, where f_s
is s's slowdown (its load, its cache, routing's jitter) and per_block_s its compute per block times f_s.
Only the way to s depends on the server before it (with push: half the ping between the two), so at each
cut the search keeps two tables, filled from the last cut back:
- `way[p, s]`: the cheapest way on from cut p whose first hop runs on s, but for getting the step to s.
  It is a running minimum per server over the cuts after p (each server's span is walked once);
- `best[p, previous]`: the cheapest way on from p for a step that comes from `previous` (None: from the
  client, and always without push).
With push, a link nobody announced is guessed as the mean of the client's round trips to both servers, so
its cost is a line in the previous server's round trip: the cheapest guessed way on is read off the lower
envelope of those lines (one per server of the cut) rather than trying every server after every previous
one; the few announced links are tried one by one.
"""

from __future__ import annotations

import bisect
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
    factor: float  # how much slower than its estimate a step there is expected (load, cache, jitter)
    per_block: float  # its compute per block, times `factor`


@dataclass(slots=True)
class _Cut:
    """What the search knows at one cut point once the cuts after it are done."""

    covering: dict[str, Candidate]  # peer id -> a server holding the block that starts here
    way: dict[str, tuple[float, int]]  # peer id -> (cost on from here through a first hop on it, its stop)
    envelope: _Envelope | None = None


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
        return _least((s.rtt * share * s.factor + cut.way[s.peer_id][0], s) for s in cut.covering.values())
    measured = links.get(previous.peer_id, {})
    if len(measured) > len(cut.covering):  # every link known (a simulation's oracle): try each server
        return _least(
            (_to(previous, s, measured) * s.factor + cut.way[s.peer_id][0], s) for s in cut.covering.values()
        )
    announced = _least(
        (rtt / 2 * s.factor + cut.way[s.peer_id][0], s)
        for peer_id, rtt in measured.items()
        if (s := cut.covering.get(peer_id)) is not None
    )
    if cut.envelope is None:
        cut.envelope = _Envelope(
            [(s.factor / 4, s.factor * s.rtt / 4 + cut.way[s.peer_id][0], s) for s in cut.covering.values()]
        )
    guessed = cut.envelope.least(previous.rtt)
    if guessed[1] is not None and guessed[1].peer_id in measured:  # its link is known: the others' least
        guessed = _least(
            (_to(previous, s, {}) * s.factor + cut.way[s.peer_id][0], s)
            for s in cut.covering.values()
            if s.peer_id not in measured
        )
    return min(announced, guessed, key=lambda option: option[0])


def _to(previous: Candidate, s: Candidate, measured: Mapping[str, float]) -> float:
    """Half the ping from `previous` to `s`: announced, or guessed from the client's round trips to both."""
    return measured.get(s.peer_id, (previous.rtt + s.rtt) / 2) / 2


def _least(options) -> tuple[float, Candidate | None]:
    return min(options, key=lambda option: option[0], default=(INF, None))


def _hops(start: int, end: int, best, table: Mapping[int, _Cut], push: bool) -> list[tuple[str, int, int]]:
    hops = []
    p, previous = start, None
    while p < end:
        cost, s = best[p, previous]
        if s is None or cost == INF:
            return []
        stop = table[p].way[s.peer_id][1]
        hops.append((s.peer_id, p, stop))
        p, previous = stop, (s.peer_id if push else None)
    return hops


class _Envelope:
    """The least of lines a x x + b (each with an item) at any x, built once and read by bisection."""

    def __init__(self, lines: list[tuple[float, float, Candidate]]):
        self.lines: list[tuple[float, float, Candidate]] = []
        self.starts: list[float] = []  # from which x each line of `lines` is the least
        for a, b, item in sorted((line for line in lines if line[1] < INF), key=lambda x: (-x[0], x[1])):
            if self.lines and self.lines[-1][0] == a:
                continue  # the same slope and a higher intercept: never the least
            x = -INF
            while self.lines:
                last_a, last_b, _ = self.lines[-1]
                x = (b - last_b) / (last_a - a)  # from here on the new line is below the last one
                if x > self.starts[-1]:
                    break
                self.lines.pop()
                self.starts.pop()
                x = -INF
            self.lines.append((a, b, item))
            self.starts.append(x)

    def least(self, x: float) -> tuple[float, Candidate | None]:
        if not self.lines:
            return INF, None
        a, b, item = self.lines[bisect.bisect_right(self.starts, x) - 1]
        return a * x + b, item
