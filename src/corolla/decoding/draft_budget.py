"""How deep to draft: the depth that gives the most tokens per second, from what each generation measures.

A speculative step with a draft of depth d emits 1 + (the drafted tokens the model accepts) tokens and
costs its drafting, its round trip through the swarm and the verification of its tokens. `DraftBudget`
keeps, per level j, the share of steps that accepted level j once they had accepted level j - 1
(`acceptance`; levels never drafted yet take the mean of those measured), and fits the cost of a whole
step as a + b * d over the recent steps. It picks the depth with the best expected tokens per
second: deep drafts when round trips are long and drafts are good, none at all when verifying costs
more than it saves (a fast local swarm and a drafter that guesses badly). Every EXPLORE_EVERY steps it
tries one level more or less, so the figures of the neighbouring depths stay fresh; while the best depth
stays the same, twice as rarely each time (at most every MAX_EXPLORE_EVERY steps). One budget serves all
generations of a model (client/generation/speculative.py `Speculator`): each starts from what the others
measured.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

PRIOR_ACCEPTANCE = 0.6  # before anything is measured: each level is accepted 60% of the time
RATE = 0.15  # weight of a new observation in the running shares
EXPLORE_EVERY = 8
MAX_EXPLORE_EVERY = 64
WINDOW = 48  # steps in the cost fit
PRIOR_SLOPE = 0.1  # until two depths have been timed: each level adds this share of a step's cost


@dataclass
class SpeculationStats:
    """Counters over generations: what drafting did (benchmarks and logs)."""

    steps: int = 0  # verification steps through the swarm (each one round trip), plain ones included
    drafted: int = 0  # tokens drafted and verified (pipelined: not those of a dropped epoch's frames)
    accepted: int = 0  # drafted tokens that the model accepted
    emitted: int = 0  # tokens emitted by those steps (accepted + the one the model chose after them)
    most_in_flight: int = 0  # the most steps (pipelined frames) sent before the first was verified

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def add(self, drafted: int, accepted: int, emitted: int, steps: int = 1, in_flight: int = 1) -> None:
        self.most_in_flight = max(self.most_in_flight, in_flight)
        self.steps += steps
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted


class DraftBudget:
    def __init__(self, max_depth: int, adaptive: bool = True):
        self.max_depth = max_depth
        self.adaptive = adaptive
        self.acceptance: list[float | None] = [None] * max_depth  # per level, once it was ever drafted
        self.observed = [0] * max_depth
        self.costs: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (depth drafted, seconds)
        self.num_steps = self.num_explorations = 0
        self.explore_every = self.next_exploration = EXPLORE_EVERY
        self.last_best = max_depth

    def depth(self, limit: int) -> int:
        """The depth to draft next, at most `limit` (what is left of max_new_tokens and of the session)."""
        limit = max(0, min(limit, self.max_depth))
        if not self.adaptive or limit == 0:
            return limit
        self.num_steps += 1
        best = max(range(limit + 1), key=self._rate)
        if self.num_steps < self.next_exploration:
            self.last_best = best
            return best
        # a neighbour, in turn above and below; while the best depth stays the same, less and less
        # often (trying to draft costs a draft model its catching up with the text)
        self.explore_every = (
            min(2 * self.explore_every, MAX_EXPLORE_EVERY) if best == self.last_best else EXPLORE_EVERY
        )
        self.next_exploration = self.num_steps + self.explore_every
        self.last_best = best
        self.num_explorations = self.num_explorations + 1
        above = self.num_explorations % 2 == 1
        return min(limit, best + 1) if above or best == 0 else best - 1

    def record(self, drafted_depth: int, accepted_depth: int, seconds: float) -> None:
        """A step drafted `drafted_depth` levels, the model accepted `accepted_depth` of them, and the
        whole step (drafting, swarm, verification) took `seconds`."""
        for j in range(min(drafted_depth, accepted_depth + 1)):  # the levels whose parent was accepted
            accepted = 1.0 if accepted_depth > j else 0.0
            known = self.acceptance[j]
            known = self._default() if known is None else known
            self.observed[j] += 1  # a running mean over the first observations, then a moving one
            self.acceptance[j] = known + max(RATE, 1 / (self.observed[j] + 1)) * (accepted - known)
        self.costs.append((drafted_depth, seconds))

    def _default(self) -> float:
        """What a level never drafted is expected to accept: what the measured levels do."""
        measured = [a for a in self.acceptance if a is not None]
        return sum(measured) / len(measured) if measured else PRIOR_ACCEPTANCE

    def expected_tokens(self, depth: int) -> float:
        default = self._default()
        expected = 1.0
        reach = 1.0
        for level in self.acceptance[:depth]:
            reach *= default if level is None else level
            expected += reach
        return expected

    def step_cost(self, depth: int) -> float:
        """a + b * depth, fitted by least squares over the recent steps."""
        if not self.costs:
            return 1.0 + PRIOR_SLOPE * depth
        depths = [d for d, _ in self.costs]
        seconds = [s for _, s in self.costs]
        mean_d = sum(depths) / len(depths)
        mean_s = sum(seconds) / len(seconds)
        spread = sum((d - mean_d) ** 2 for d in depths)
        if spread == 0:
            base = mean_s / (1 + PRIOR_SLOPE * mean_d)
            return base * (1 + PRIOR_SLOPE * depth)
        slope = sum((d - mean_d) * (s - mean_s) for d, s in self.costs) / spread
        slope = max(slope, 0.0)  # drafting more never makes a step cheaper; noise can say otherwise
        return max(mean_s + slope * (depth - mean_d), 1e-6)

    def _rate(self, depth: int) -> float:
        return self.expected_tokens(depth) / self.step_cost(depth)
