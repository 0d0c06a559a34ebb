"""Choosing a chain of servers that covers a range of blocks.

Pure logic over the spans read from the DHT. The chain has the fewest hops (each hop costs a network
round trip); among equally short chains the choice is random, which spreads sessions over replicas.
A hop may use only part of a server's span. When some block has no server, `MissingBlocks` names it.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from corolla.errors import MissingBlocks
from corolla.swarm.dht import RemoteSpan


@dataclass(frozen=True, slots=True)
class Hop:
    peer_id: str
    start: int
    end: int


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
    rng: random.Random | None = None,
    allowed: Collection[str] | None = None,
    banned: Collection[str] = (),
) -> list[Hop]:
    """Fewest-hops chain over blocks [start, end); raises MissingBlocks if some block is not served."""
    rng = rng or random.Random()
    usable = [s for s in spans if s.peer_id not in banned and (allowed is None or s.peer_id in allowed)]
    missing = uncovered_blocks(usable, start, end)
    if missing:
        raise MissingBlocks(
            f"no server available for blocks {format_blocks(missing)} "
            f"(of {start}:{end}; {len(usable)} usable servers)",
            missing,
        )
    # fewest hops to reach each block boundary, by dynamic programming from the end
    hops_to_end: dict[int, int] = {end: 0}
    choices: dict[int, list[RemoteSpan]] = {}
    for position in range(end - 1, start - 1, -1):
        best, best_spans = None, []
        for span in usable:
            if span.start <= position < span.end:
                reach = min(span.end, end)
                cost = hops_to_end[reach] + 1
                if best is None or cost < best:
                    best, best_spans = cost, [span]
                elif cost == best:
                    best_spans.append(span)
        hops_to_end[position] = best
        choices[position] = best_spans
    chain, position = [], start
    while position < end:
        span = rng.choice(choices[position])
        reach = min(span.end, end)
        chain.append(Hop(span.peer_id, position, reach))
        position = reach
    return chain
