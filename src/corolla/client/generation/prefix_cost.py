"""Whether a generation forks the chain holding its prompt's prefix or prefills the prefix on the cheapest
chain (issue 30: routing that finds reused prefixes).

Forking saves the prefix's prefill; it costs, for every token the answer decodes, what a step on the
holding chain costs more than one on the cheapest chain (routing's step-time estimates, `Router.step_cost`;
the holder's session, idle, is no load on its chain: counted as one, it priced the holding chain up by its
servers' batch growth, 20-28% as SmolLM2's servers measured it, and a follow-up turn went elsewhere).
How many tokens an answer decodes is not known in advance: a request's `max_new_tokens` is only a limit
(the API's default is the whole context), so the guess is the mean of this client's recent answers, under
that limit.
"""

from __future__ import annotations

from collections import deque
from statistics import fmean
from typing import TYPE_CHECKING

from corolla.errors import CorollaError

if TYPE_CHECKING:
    from corolla.client.chain.session import InferenceSession

# a prompt's tokens a chain prefills in one decode step's time (bench/decode/prefix.py: 1,554 prompt tokens
# took 58 decode steps' time on CPU servers, on loopback and across the emulated internet alike)
PREFILL_TOKENS_PER_STEP = 27
# chains whose step-time estimates are within this ratio count as equally fast: estimates of equal
# replicas, timed on shared machines, drift apart by this much
ALIKE = 1.25
DEFAULT_ANSWER = 128  # tokens an answer is guessed to decode before this client has seen one
RECENT_ANSWERS = 32  # the guess is the mean of this many recent answers


class AnswerLengths:
    """How many tokens this client's generations decode, recently."""

    def __init__(self) -> None:
        self.recent: deque[int] = deque(maxlen=RECENT_ANSWERS)

    def add(self, tokens: int) -> None:
        self.recent.append(max(tokens, 0))

    def expected(self, limit: int) -> int:
        """The tokens a generation allowed to decode at most `limit` is expected to decode."""
        guess = round(fmean(self.recent)) if self.recent else DEFAULT_ANSWER
        return max(min(guess, limit), 0)


def fork_pays(held: float, best: float, length: int, steps: int) -> bool:
    """Whether decoding `steps` tokens on a chain whose steps take `held` seconds, after reusing the
    `length` tokens it holds, costs no more than prefilling them on a chain whose steps take `best`."""
    if held <= best * ALIKE:
        return True
    return (held - best) * steps <= length / PREFILL_TOKENS_PER_STEP * best


async def holding_chain_pays(
    session: InferenceSession, holder: InferenceSession, length: int, steps: int
) -> bool:
    """`fork_pays` for `session` forking `holder`'s chain, against the cheapest chain it may use now."""
    router = session.chain.swarm.router
    spec = session.chain.spec
    try:
        best = await router.route(
            needed_cache=spec.max_length,
            max_length=spec.max_length,
            avoid=spec.avoid,
            allowed=spec.allowed,
            wait=False,
        )
    except CorollaError:  # nothing else is routable now: the holding chain is checked when forking
        return True
    # the holder's own session sits idle on that chain (kept for its prefix): no load there
    held_cost = router.step_cost(holder.route, spec.max_length, idle=holder.route)
    return fork_pays(held_cost, router.step_cost(best, spec.max_length), length, steps)
