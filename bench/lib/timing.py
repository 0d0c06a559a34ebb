"""Timers for benchmarks: when tokens arrive, the decode rate after the first token, the gaps between
tokens, their percentiles (numpy's, interpolated), and a piece of work timed over and over.

Owns the arithmetic only: what to run and what to call a figure in a result stays with each script.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np


class Stamps:
    """When each new token arrived: a transformers streamer (`put`: its first call carries the prompt, not
    a token), or a corolla streamer (`stamp`, called once per new token)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value: object) -> None:
        if self.prompt_seen:
            self.stamp()
        self.prompt_seen = True

    def end(self) -> None:
        pass

    def stamp(self, *_: object) -> None:
        self.times.append(time.perf_counter())


def decode_rate(times: Sequence[float], rows: int = 1) -> float:
    """Tokens per second after the first token (the first one includes the prefill), `rows` at a time."""
    return rows * (len(times) - 1) / (times[-1] - times[0])


def gaps(times: Sequence[float], skip: int = 0) -> list[float]:
    """Seconds between consecutive tokens, less the first `skip` gaps (the first includes the prefill)."""
    return [b - a for a, b in zip(times[skip:], times[skip + 1 :], strict=False)]


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`th percentile (0-100), interpolated between the nearest values."""
    return float(np.percentile(values, q))


def ms(seconds: float, digits: int = 1) -> float:
    """Seconds as milliseconds, rounded for a report."""
    return round(1000 * seconds, digits)


def durations(work: Callable[[], object], repeats: int, warmup: int = 0) -> list[float]:
    """Seconds of each of `repeats` calls of `work`, after `warmup` calls that are not kept."""
    times = []
    for _ in range(warmup + repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return times[warmup:]
