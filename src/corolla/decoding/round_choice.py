"""Pipelined or synchronous speculation: whichever has emitted the most tokens per second, measured.

Pipelining (client/generation/pipelined.py) pays where round trips are long: the chain computes while
replies travel. Where they are short (a local swarm) the frames it sends past a rejected draft cost the
servers compute that nobody uses, and synchronous rounds, whose depth the `DraftBudget` tunes, do
better. `RoundChoice` keeps the tokens and seconds of the recent rounds of each kind, tries each kind
TRIES times first, then takes the faster one and now and then the other one once, so a swarm whose round
trips change is followed: after EXPLORE_EVERY choices, then, while the faster kind stays the same, twice
as rarely each time (at most every MAX_EXPLORE_EVERY choices). A pipelined round is measured and chosen
again in segments (the tokens from one rejected draft to the first rejection after SEGMENT_TOKENS more),
so trying it costs a few tokens, not the rest of a generation. One choice serves all generations of a model.
"""

from __future__ import annotations

from collections import deque

TRIES = 2  # rounds (segments) of each kind before the figures decide
EXPLORE_EVERY = 16
MAX_EXPLORE_EVERY = 128
WINDOW = 8  # rounds of each kind in the figures
SEGMENT_TOKENS = 16  # a pipelined round is measured, and may end, at its first rejection after this many


class RoundChoice:
    def __init__(self, pipeline: int, adaptive: bool = True):
        self.pipeline = pipeline  # frames in flight when pipelined (1: never)
        self.adaptive = adaptive  # False: pipelined whenever pipeline > 1
        self.choices = 0
        self._seen: dict[bool, deque[tuple[int, float]]] = {
            kind: deque(maxlen=WINDOW) for kind in (False, True)
        }
        self.explore_every = EXPLORE_EVERY
        self.next_exploration = EXPLORE_EVERY
        self.last_best: bool | None = None

    def pipelined(self) -> bool:
        """Whether the next round (or a pipelined round's next segment) is pipelined."""
        if self.pipeline <= 1 or not self.adaptive:
            return self.pipeline > 1
        self.choices += 1
        for kind in (True, False):
            if len(self._seen[kind]) < TRIES:
                return kind
        best = self.rate(True) >= self.rate(False)
        if self.choices < self.next_exploration:
            self.last_best = best
            return best
        same = best == self.last_best
        self.explore_every = min(2 * self.explore_every, MAX_EXPLORE_EVERY) if same else EXPLORE_EVERY
        self.next_exploration = self.choices + self.explore_every
        self.last_best = best
        return not best

    def record(self, pipelined: bool, tokens: int, seconds: float) -> None:
        self._seen[pipelined].append((tokens, seconds))

    def rate(self, pipelined: bool) -> float:
        """Tokens per second of the recent rounds of that kind."""
        seen = self._seen[pipelined]
        seconds = sum(s for _, s in seen)
        return sum(t for t, _ in seen) / seconds if seconds > 0 else 0.0
