"""Pipelined or synchronous speculation: whichever has emitted the most tokens per second, measured.

Pipelining (client/generation/pipelined.py) pays where round trips are long: the chain computes while
replies travel. Where they are short (a local swarm) the frames it sends past a rejected draft cost the
servers compute that nobody uses, and synchronous rounds, whose depth the `DraftBudget` tunes, do
better. `RoundChoice` keeps the tokens and seconds of the recent rounds of each kind, tries each kind
TRIES times first, then takes the faster one, and every EXPLORE_EVERY rounds the other one once, so a
swarm whose round trips change is followed. One choice serves all generations of a model.
"""

from __future__ import annotations

from collections import deque

TRIES = 2  # rounds of each kind before the figures decide
EXPLORE_EVERY = 16
WINDOW = 8  # rounds of each kind in the figures


class RoundChoice:
    def __init__(self, pipeline: int, adaptive: bool = True):
        self.pipeline = pipeline  # frames in flight when pipelined (1: never)
        self.adaptive = adaptive  # False: pipelined whenever pipeline > 1
        self.rounds = 0
        self._seen: dict[bool, deque[tuple[int, float]]] = {
            kind: deque(maxlen=WINDOW) for kind in (False, True)
        }

    def pipelined(self) -> bool:
        """Whether the next round is pipelined."""
        if self.pipeline <= 1 or not self.adaptive:
            return self.pipeline > 1
        self.rounds += 1
        for kind in (True, False):
            if len(self._seen[kind]) < TRIES:
                return kind
        best = self.rate(True) >= self.rate(False)
        return not best if self.rounds % EXPLORE_EVERY == 0 else best

    def record(self, pipelined: bool, tokens: int, seconds: float) -> None:
        self._seen[pipelined].append((tokens, seconds))

    def rate(self, pipelined: bool) -> float:
        """Tokens per second of the recent rounds of that kind."""
        seen = self._seen[pipelined]
        seconds = sum(s for _, s in seen)
        return sum(t for t, _ in seen) / seconds if seconds > 0 else 0.0
