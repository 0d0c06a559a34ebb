"""How many frames of pipelined speculation to keep in flight, 1 being synchronous rounds: whichever number
has emitted the most tokens per second, measured.

Pipelining (client/generation/pipelined.py) pays where round trips are long: the chain computes while
replies travel, and the longer the trip against a frame's compute, the more frames it takes to keep the
chain busy. Where trips are short (a local swarm) the frames sent past a rejected draft cost the servers
compute that nobody uses, and synchronous rounds, whose depth the `DraftBudget` tunes, do better; where
drafts are often rejected, fewer frames in flight waste less. `RoundChoice` keeps the tokens and seconds
of the recent rounds at each depth in flight, tries the deepest and synchronous rounds TRIES times first,
then takes the fastest and now and then a depth next to it once, so a swarm whose round trips or drafts
change is followed step by step: after EXPLORE_EVERY choices, then, while the fastest stays the same,
twice as rarely each time (at most every MAX_EXPLORE_EVERY choices). A pipelined round is measured and
chosen again in segments (the tokens from one rejected draft to the first rejection after SEGMENT_TOKENS
more), so trying a depth costs a few tokens, not the rest of a generation. One choice serves all
generations of a model.
"""

from __future__ import annotations

from collections import deque

TRIES = 2  # rounds (segments) of the deepest pipeline and of synchronous rounds before the figures decide
EXPLORE_EVERY = 16
MAX_EXPLORE_EVERY = 128
WINDOW = 8  # rounds of each depth in the figures
SEGMENT_TOKENS = 16  # a pipelined round is measured, and may end, at its first rejection after this many


class RoundChoice:
    def __init__(self, pipeline: int, adaptive: bool = True):
        self.pipeline = max(pipeline, 1)  # the most frames in flight (1: never pipelined)
        self.adaptive = adaptive  # False: always `pipeline` frames in flight
        self.choices = 0
        self._seen: dict[int, deque[tuple[int, float]]] = {
            depth: deque(maxlen=WINDOW) for depth in range(1, self.pipeline + 1)
        }
        self.explore_every = EXPLORE_EVERY
        self.next_exploration = EXPLORE_EVERY
        self.last_best: int | None = None
        self._explored_up = False  # the side of the fastest depth explored last

    def depth(self) -> int:
        """Frames in flight for the next round (or a pipelined round's next segment): 1 is synchronous."""
        if self.pipeline <= 1 or not self.adaptive:
            return self.pipeline
        self.choices += 1
        for depth in (self.pipeline, 1):
            if len(self._seen[depth]) < TRIES:
                return depth
        best = max(self._seen, key=lambda depth: (self.rate(depth), depth))
        if self.choices < self.next_exploration:
            self.last_best = best
            return best
        same = best == self.last_best
        self.explore_every = min(2 * self.explore_every, MAX_EXPLORE_EVERY) if same else EXPLORE_EVERY
        self.next_exploration = self.choices + self.explore_every
        self.last_best = best
        return self._neighbour(best)

    def _neighbour(self, best: int) -> int:
        """A depth next to the fastest: one never measured first, else the other side than last time."""
        sides = [depth for depth in (best - 1, best + 1) if depth in self._seen]
        untried = [depth for depth in sides if not self._seen[depth]]
        if untried:
            return untried[0]
        if len(sides) == 1:
            return sides[0]
        self._explored_up = not self._explored_up
        return sides[1] if self._explored_up else sides[0]

    def record(self, depth: int, tokens: int, seconds: float) -> None:
        self._seen[min(max(depth, 1), self.pipeline)].append((tokens, seconds))

    def rate(self, depth: int) -> float:
        """Tokens per second of the recent rounds at that depth in flight."""
        seen = self._seen[depth]
        seconds = sum(s for _, s in seen)
        return sum(t for t, _ in seen) / seconds if seconds > 0 else 0.0
