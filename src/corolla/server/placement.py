"""Which blocks a new server should host, given what the swarm already covers.

The chosen window is the one whose least-covered block is least covered (then the one with the least
total coverage, then the earliest): a new server first fills holes, then thickens the thinnest part.
"""

from __future__ import annotations

from collections.abc import Iterable


def coverage(spans: Iterable[tuple[int, int]], total: int) -> list[int]:
    """How many servers host each block."""
    counts = [0] * total
    for start, end in spans:
        for index in range(max(start, 0), min(end, total)):
            counts[index] += 1
    return counts


def choose_blocks(spans: Iterable[tuple[int, int]], num_blocks: int, total: int) -> tuple[int, int]:
    counts = coverage(spans, total)
    best = min(
        range(total - num_blocks + 1),
        key=lambda start: (
            min(counts[start : start + num_blocks]),
            sum(counts[start : start + num_blocks]),
            start,
        ),
    )
    return best, best + num_blocks
