"""Choosing a chain of servers that covers a range of blocks: the one with the lowest expected step time.

Pure logic over the spans read from the DHT and what the client knows of each server (`Estimate`: its
round-trip time, its time per block per step, its load). A hop costs a round trip plus its blocks'
compute, the compute slowed by the sessions already on the server, so the best chain has few hops on
fast, lightly loaded servers; a little random jitter breaks ties, which spreads sessions over equal
replicas. A hop may use only part of a server's span. When some block has no server, `MissingBlocks` names it.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from corolla.errors import MissingBlocks, counted
from corolla.swarm.dht import RemoteSpan
from corolla.swarm.policy import chain_search
from corolla.swarm.policy.chain_search import Candidate

DEFAULT_RTT = 0.005  # seconds; used until a server has been pinged
DEFAULT_SECONDS_PER_BLOCK = 0.01  # used until a server's throughput is announced or observed
# each session already on a server makes a step there this much slower, unless the server said what it
# measured (Estimate.load_growth): a guess that errs on the side of spreading (a batched pass grows ~10% per
# row on a CPU, and queues form beyond that; on a GPU a pass grows little until its compute is the bound)
LOAD_WEIGHT = 0.25
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
    load_growth: float = LOAD_WEIGHT  # a step's slowdown per session on the server (its own measure)


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
    cache than `needed_cache` tokens counts at half its speed: it can take the session, but may have to
    wait. No hop starts or ends at a `forbidden_cuts` block (inside a group of layers sharing keys and values,
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
    return _cheapest(usable, start, end, estimate, noise, links or {}, push, needed_cache, forbidden_cuts)


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
        total += costs.to(previous, hop.peer_id) + compute * _slowdown(estimate[hop.peer_id], needed_cache)
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
        if not self.push:
            return self.estimate[peer_id].rtt
        if previous is None:
            return self.estimate[peer_id].rtt / 2
        # not announced: guessed from the client's round trips to both (as swarm/policy/chain_search.py does)
        guess = (self.estimate[previous].rtt + self.estimate[peer_id].rtt) / 2
        return self.links.get(previous, {}).get(peer_id, guess) / 2

    def back(self, last: str) -> float:
        return self.estimate[last].rtt / 2 if self.push else 0.0


def _cheapest(  # noqa: PLR0913
    usable: Sequence[RemoteSpan],
    start: int,
    end: int,
    estimate: Mapping[str, Estimate],
    noise: Mapping[str, float],
    links: Mapping[str, Mapping[str, float]],
    push: bool,
    needed_cache: int,
    forbidden_cuts: frozenset[int],
) -> list[Hop]:
    """The cheapest chain from `start` to `end` (swarm/policy/chain_search.py): a hop on server s costs the
    step's way to s + its compute x s's slowdown."""
    candidates = []
    for span in usable:
        own = estimate[span.peer_id]
        factor = _slowdown(own, needed_cache) * noise[span.peer_id]
        candidates.append(
            Candidate(span.peer_id, span.start, span.end, own.rtt, own.seconds_per_block * factor)
        )
    cuts = _cut_points(usable, start, end, forbidden_cuts)
    cost, hops = chain_search.cheapest(candidates, start, cuts, links, push)
    if cost == float("inf"):
        raise _uncuttable(start, end, forbidden_cuts)
    return [Hop(*hop) for hop in hops]


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
    slowdown = 1 + estimate.load_growth * estimate.load
    if estimate.free_cache is not None and estimate.free_cache < needed_cache:
        slowdown *= 2
    return slowdown
