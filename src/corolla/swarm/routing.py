"""Choosing a chain of servers that covers a range of blocks: the one with the lowest expected step time.

Pure logic over the spans read from the DHT and what the client knows of each server (`Estimate`: its
round-trip time, its time per block per step, its load). A hop costs a round trip plus its blocks' compute,
slowed by the sessions already on the server, so the best chain has few hops on fast, lightly loaded
servers; a little random jitter breaks ties, which spreads sessions over equal replicas. A hop may use
only part of a server's span. When some block has no server, `MissingBlocks` names it.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from corolla.errors import MissingBlocks
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

    def hop_cost(self, num_blocks: int) -> float:
        return (self.rtt + num_blocks * self.seconds_per_block) * (1 + LOAD_WEIGHT * self.load)


def uncovered_blocks(spans: Sequence[RemoteSpan], start: int, end: int) -> tuple[int, ...]:
    covered = set()
    for span in spans:
        covered.update(range(max(span.start, start), min(span.end, end)))
    return tuple(i for i in range(start, end) if i not in covered)


def format_blocks(blocks: Sequence[int]) -> str:
    """Compact ranges: (0, 1, 2, 5) -> '0-2, 5'."""
    parts, run_start = [], None
    for i, block in enumerate(blocks):
        if run_start is None:
            run_start = block
        if i + 1 == len(blocks) or blocks[i + 1] != block + 1:
            parts.append(str(run_start) if run_start == block else f"{run_start}-{block}")
            run_start = None
    return ", ".join(parts)


def choose_chain(
    spans: Sequence[RemoteSpan],
    start: int,
    end: int,
    *,
    estimates: Mapping[str, Estimate] | None = None,
    rng: random.Random | None = None,
    allowed: Collection[str] | None = None,
    banned: Collection[str] = (),
) -> list[Hop]:
    """The cheapest chain over blocks [start, end); raises MissingBlocks if some block is not served."""
    rng, estimates = rng or random.Random(), estimates or {}
    usable = [s for s in spans if s.peer_id not in banned and (allowed is None or s.peer_id in allowed)]
    missing = uncovered_blocks(usable, start, end)
    if missing:
        raise MissingBlocks(
            f"no server available for blocks {format_blocks(missing)} "
            f"(of {start}:{end}; {len(usable)} usable servers)",
            missing,
        )
    noise = {s.peer_id: 1 + JITTER * rng.random() for s in usable}
    # cheapest way from each block boundary to `end`, by dynamic programming from the end
    best: dict[int, tuple[float, Hop | None]] = {end: (0.0, None)}
    for position in range(end - 1, start - 1, -1):
        options = []
        for span in usable:
            if not span.start <= position < span.end:
                continue
            estimate = estimates.get(span.peer_id, Estimate())
            for stop in range(position + 1, min(span.end, end) + 1):
                cost = estimate.hop_cost(stop - position) * noise[span.peer_id] + best[stop][0]
                options.append((cost, Hop(span.peer_id, position, stop)))
        best[position] = min(options, key=lambda option: option[0])
    chain, position = [], start
    while position < end:
        hop = best[position][1]
        chain.append(hop)
        position = hop.end
    return chain
