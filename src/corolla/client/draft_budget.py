"""How deep to draft: the depth that gives the most tokens per second, from what each generation measures.

A speculative step with a draft of depth d emits 1 + (the drafted tokens the model accepts) tokens and
costs its drafting, its round trip through the swarm and the verification of its tokens. `DraftBudget`
keeps, per depth j, the share of steps whose accepted path reached j (`reach`), and fits the cost of a
whole step as a + b * d over the recent steps. It picks the depth with the best expected tokens per
second: deep drafts when round trips are long and drafts are good, none at all when verifying costs
more than it saves (a fast local swarm and a drafter that guesses badly). Every EXPLORE_EVERY steps it
tries one level more or less, so the figures of the neighbouring depths stay fresh.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

PRIOR_REACH = 0.6  # before anything is measured: each level is accepted 60% of the time
RATE = 0.15  # weight of a new observation in the running shares
EXPLORE_EVERY = 8
WINDOW = 48  # steps in the cost fit
PRIOR_SLOPE = 0.1  # until two depths have been timed: each level adds this share of a step's cost


@dataclass
class SpeculationStats:
    """Counters over generations: what drafting did (benchmarks and logs)."""

    steps: int = 0  # verification steps through the swarm (each one round trip), plain ones included
    drafted: int = 0  # tokens drafted
    accepted: int = 0  # drafted tokens that the model accepted
    emitted: int = 0  # tokens emitted by those steps (accepted + the one the model chose after them)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def add(self, drafted: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted


class DraftBudget:
    def __init__(self, max_depth: int, adaptive: bool = True):
        self.max_depth, self.adaptive = max_depth, adaptive
        self.reach = [PRIOR_REACH ** (j + 1) for j in range(max_depth)]
        self.costs: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (depth drafted, seconds)
        self.num_steps = 0
        self.last_best = max_depth

    def depth(self, limit: int) -> int:
        """The depth to draft next, at most `limit` (what is left of max_new_tokens and of the session)."""
        limit = max(0, min(limit, self.max_depth))
        if not self.adaptive or limit == 0:
            return limit
        self.num_steps += 1
        best = max(range(limit + 1), key=self._rate)
        self.last_best = best
        if self.num_steps % EXPLORE_EVERY == 0:  # a neighbour, in turn above and below
            above = (self.num_steps // EXPLORE_EVERY) % 2 == 1
            return min(limit, best + 1) if above or best == 0 else best - 1
        return best

    def record(self, drafted_depth: int, accepted_depth: int, seconds: float) -> None:
        """A step drafted `drafted_depth` levels, the model accepted `accepted_depth` of them, and the
        whole step (drafting, swarm, verification) took `seconds`."""
        for j in range(drafted_depth):
            reached = 1.0 if accepted_depth > j else 0.0
            self.reach[j] += RATE * (reached - self.reach[j])
        self.costs.append((drafted_depth, seconds))

    def expected_tokens(self, depth: int) -> float:
        return 1.0 + sum(self.reach[:depth])

    def step_cost(self, depth: int) -> float:
        """a + b * depth, fitted by least squares over the recent steps."""
        if not self.costs:
            return 1.0 + PRIOR_SLOPE * depth
        depths = [d for d, _ in self.costs]
        seconds = [s for _, s in self.costs]
        mean_d, mean_s = sum(depths) / len(depths), sum(seconds) / len(seconds)
        spread = sum((d - mean_d) ** 2 for d in depths)
        if spread == 0:
            base = mean_s / (1 + PRIOR_SLOPE * mean_d)
            return base * (1 + PRIOR_SLOPE * depth)
        slope = sum((d - mean_d) * (s - mean_s) for d, s in self.costs) / spread
        slope = max(slope, 0.0)  # drafting more never makes a step cheaper; noise can say otherwise
        return max(mean_s + slope * (depth - mean_d), 1e-6)

    def _rate(self, depth: int) -> float:
        return self.expected_tokens(depth) / self.step_cost(depth)
