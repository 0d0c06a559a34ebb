"""Choosing a chain of servers that covers a range of blocks: the one with the lowest expected step time.

Pure logic over the spans read from the DHT and what the client knows of each server (`Estimate`: its
round-trip time, its time per block per step, its load). A hop costs a round trip plus its blocks' compute,
slowed by the sessions already on the server, so the best chain has few hops on fast, lightly loaded
servers; a little random jitter breaks ties, which spreads sessions over equal replicas. A hop may use
only part of a server's span. When some block has no server, `MissingBlocks` names it.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from corolla.errors import MissingBlocks, counted
from corolla.swarm.dht import RemoteSpan

DEFAULT_RTT = 0.005  # seconds; used until a server has been pinged
DEFAULT_SECONDS_PER_BLOCK = 0.01  # used until a server's throughput is announced or observed
LOAD_WEIGHT = 0.25  # each session already on a server makes a step there this much slower (a guess that
# errs on the side of spreading: a batched pass grows ~10% per row on a CPU, and queues form beyond that)
JITTER = 0.02  # relative noise on each server's cost: equal replicas are chosen at random


@dataclass(frozen=True, slots=True)
class Hop:
    peer_id: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Estimate:
    """What the client expects of one server for one decode step."""

    rtt: float = DEFAULT_RTT
    seconds_per_block: float = DEFAULT_SECONDS_PER_BLOCK
    load: float = 0.0  # sessions on the server (announced, plus this client's own)
    free_cache: int | None = None  # tokens of attention cache it has left (announced)


def uncovered_blocks(spans: Sequence[RemoteSpan], start: int, end: int) -> tuple[int, ...]:
    covered = set()
    for span in spans:
        covered.update(range(max(span.start, start), min(span.end, end)))
    return tuple(i for i in range(start, end) if i not in covered)


def format_blocks(blocks: Sequence[int]) -> str:
    """Compact ranges: (0, 1, 2, 5) -> '0-2, 5'."""
    parts = []
    run_start = None
    for i, block in enumerate(blocks):
        if run_start is None:
            run_start = block
        if i + 1 == len(blocks) or blocks[i + 1] != block + 1:
            parts.append(str(run_start) if run_start == block else f"{run_start}-{block}")
            run_start = None
    return ", ".join(parts)


def choose_chain(  # noqa: PLR0913 (keywords: everything a chain's cost weighs)
    spans: Sequence[RemoteSpan],
    start: int,
    end: int,
    *,
    estimates: Mapping[str, Estimate] | None = None,
    links: Mapping[str, Mapping[str, float]] | None = None,
    push: bool = False,
    needed_cache: int = 0,
    rng: random.Random | None = None,
    forbidden_cuts: frozenset[int] = frozenset(),
) -> list[Hop]:
    """The cheapest chain over blocks [start, end); raises MissingBlocks if some block is not served.

    Without push every hop costs a round trip from the client plus its compute. With push (servers pass
    each step along) a step costs half a round trip to the first server, the compute and half a ping
    between each pair of consecutive servers (`links[a][b]`, measured by the servers, or estimated from
    the client's round trips), and half a round trip back from the last one. A server with less free
    cache than `needed_cache` tokens counts double: it can take the session, but may have to wait. No hop
    starts or ends at a `forbidden_cuts` block (inside a group of layers sharing keys and values,
    models/kv_sharing.py), whatever the servers' spans.
    """
    rng = rng or random.Random()
    estimates = estimates or {}
    usable = [s for s in spans if s.start < end and start < s.end]  # the servers of these blocks
    missing = uncovered_blocks(usable, start, end)
    if missing:
        raise MissingBlocks(
            f"no server available for blocks {format_blocks(missing)} "
            f"(of {start}:{end}; {counted(len(usable), 'usable server')} of these blocks)",
            missing,
        )
    noise = {s.peer_id: 1 + JITTER * rng.random() for s in usable}
    estimate = {s.peer_id: estimates.get(s.peer_id, Estimate()) for s in usable}
    costs = _LinkCosts(estimate, links or {}, push)
    return _cheapest(usable, start, end, estimate, noise, costs, needed_cache, forbidden_cuts)


def chain_cost(
    hops: Sequence[Hop],
    estimates: Mapping[str, Estimate],
    links: Mapping[str, Mapping[str, float]] | None = None,
    push: bool = False,
    needed_cache: int = 0,
) -> float:
    """The expected decode-step time of a given chain: what `choose_chain` minimises, without its jitter."""
    estimate = {hop.peer_id: estimates.get(hop.peer_id, Estimate()) for hop in hops}
    costs = _LinkCosts(estimate, links or {}, push)
    total = 0.0
    previous = None
    for hop in hops:
        compute = (hop.end - hop.start) * estimate[hop.peer_id].seconds_per_block
        total += (costs.to(previous, hop.peer_id) + compute) * _slowdown(estimate[hop.peer_id], needed_cache)
        previous = hop.peer_id
    return total + (costs.back(previous) if previous is not None else 0.0)


@dataclass(frozen=True)
class _LinkCosts:
    """What it costs to get a step to a server (from the client, or from the previous server with push)
    and back from the last one."""

    estimate: Mapping[str, Estimate]
    links: Mapping[str, Mapping[str, float]]
    push: bool

    def to(self, previous: str | None, peer_id: str) -> float:
        return self.to_each(previous, [peer_id])[0]

    def to_each(self, previous: str | None, peer_ids: Sequence[str]) -> list[float]:
        """`to` each of `peer_ids` (routing asks for every server of a position at once)."""
        estimate = self.estimate
        if not self.push:
            return [estimate[peer_id].rtt for peer_id in peer_ids]
        if previous is None:
            return [estimate[peer_id].rtt / 2 for peer_id in peer_ids]
        measured = self.links.get(previous, {})
        rtt = estimate[previous].rtt  # not announced: guess from the client's round trips to both
        return [measured.get(peer_id, (rtt + estimate[peer_id].rtt) / 2) / 2 for peer_id in peer_ids]

    def back(self, last: str) -> float:
        return self.estimate[last].rtt / 2 if self.push else 0.0


def _cheapest(
    usable: Sequence[RemoteSpan],
    start: int,
    end: int,
    estimate: Mapping[str, Estimate],
    noise: Mapping[str, float],
    links: _LinkCosts,
    needed_cache: int,
    forbidden_cuts: frozenset[int],
) -> list[Hop]:
    """The cheapest chain from `start` to `end`, by dynamic programming over cut points. A hop on server s
    costs (the step's way to s + compute) x s's slowdown; only the way to s depends on the previous
    server, so the cheapest way on through s (`onward`) is shared by every previous server. Without push
    nothing depends on the previous server (one state per position)."""
    boundaries = _cut_points(usable, start, end, forbidden_cuts)
    factor = {s.peer_id: _slowdown(estimate[s.peer_id], needed_cache) * noise[s.peer_id] for s in usable}
    covering = {p: [s for s in usable if s.start <= p < s.end] for p in [start, *boundaries]}

    @functools.cache
    def onward(position: int) -> list[tuple[str, float, tuple[float, tuple[Hop, ...]]]]:
        """For each server of `position`: its peer id, its slowdown, and the cheapest way from `position`
        to `end` whose first hop runs there, but for the cost of getting the step to it."""
        found = []
        for span in covering[position]:
            per_block = estimate[span.peer_id].seconds_per_block * factor[span.peer_id]
            options = []
            for stop in (b for b in boundaries if position < b <= min(span.end, end)):
                rest_cost, rest = best(stop, span.peer_id if links.push else None)
                hop = Hop(span.peer_id, position, stop)
                options.append(((stop - position) * per_block + rest_cost, (hop, *rest)))
            way = min(options, key=lambda option: option[0], default=(float("inf"), ()))
            found.append((span.peer_id, factor[span.peer_id], way))
        return found

    @functools.cache
    def best(position: int, previous: str | None) -> tuple[float, tuple[Hop, ...]]:
        """The cheapest way from `position` to `end`, coming from `previous`."""
        if position == end:
            return links.back(previous) if previous is not None else 0.0, ()
        servers = onward(position)
        reach = links.to_each(previous, [peer_id for peer_id, _, _ in servers])
        options = ((to * f + cost, chain) for to, (_, f, (cost, chain)) in zip(reach, servers, strict=True))
        # none: every way on would cut a group of layers that share keys and values
        return min(options, key=lambda option: option[0], default=(float("inf"), ()))

    cost, chain = best(start, None)
    if cost == float("inf"):
        raise _uncuttable(start, end, forbidden_cuts)
    return list(chain)


def _uncuttable(start: int, end: int, forbidden_cuts: frozenset[int]) -> MissingBlocks:
    inside = tuple(sorted(c for c in forbidden_cuts if start < c < end))
    return MissingBlocks(
        f"no chain of servers covers blocks {start}:{end} without splitting layers that share keys "
        f"and values (blocks {format_blocks(inside)} must run on the server of the block before them)",
        inside,
    )


def _cut_points(usable: Sequence[RemoteSpan], start: int, end: int, forbidden: frozenset[int]) -> list[int]:
    """Where a hop of the cheapest chain may end: where a server's span starts or ends. Between two such
    points the same servers hold every block, so a hop's cost grows linearly with where it ends there:
    when a point may not be cut (inside layers that share keys and values), the cheapest cut between two
    points is the first or the last one allowed."""
    points = sorted({b for s in usable for b in (s.start, s.end) if start < b < end} | {start, end})
    cuts = {end}
    for low, high in itertools.pairwise(points):
        allowed = [p for p in range(low, high + 1) if p not in forbidden]
        cuts.update(allowed[:1] + allowed[-1:])
    return sorted(cuts - {start})


def _slowdown(estimate: Estimate, needed_cache: int) -> float:
    """How much a server's load is expected to stretch a step there."""
    slowdown = 1 + LOAD_WEIGHT * estimate.load
    if estimate.free_cache is not None and estimate.free_cache < needed_cache:
        slowdown *= 2
    return slowdown
