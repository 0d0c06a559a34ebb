"""Spot checks: a share of a server's work re-run elsewhere and compared, to catch servers that lie.

`deviation` is the one comparison: per position, the L2 distance between two servers' hidden states
relative to the reference's norm. Honest replicas in other precisions (bfloat16, float16, int8, int4)
stay well within TOLERANCE; every simulated fault (server/faults.py) goes far past it
(bench/spot_check_calibration.py measures both).

A check of one hop of an inference session sends what that hop has computed since its last check to a
shadow session on other servers over the same blocks (client/shadows.py), and compares the outputs not
yet verified. Outputs that disagree get a third opinion from servers outside both chains (the whole
history as one forward pass there); the side that the third opinion contradicts is faulty (both, when
there is no third opinion: a client cannot tell). Faulty servers are banned for good by this client,
reported (log, counters) and the session rewinds to the first wrong position (client/inference_session.py).

Training passes (client/autograd.py) are checked the same way, each hop's forward and backward with
probability `share`: the pass is run again on other servers and its result compared, a forward's per
position, a backward's gradients (wrt the inputs and the deep prompts) as one vector within
GRADIENT_TOLERANCE; a faulty hop's pass is redone on other servers.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from corolla.client.remote_passes import remote_forward
from corolla.client.shadows import Shadow, open_shadow
from corolla.client.swarm import RETRYABLE
from corolla.errors import CorollaError, MissingBlocks
from corolla.swarm.routing import Hop

if TYPE_CHECKING:
    from corolla.client.span_session import SpanSession
    from corolla.client.swarm import SwarmClient

logger = logging.getLogger(__name__)

EPSILON = 1e-6
# SmolLM2, every pair of float32, bfloat16, float16, int8 and int4 replicas: at most 0.09 over 10 blocks and
# 0.14 over all 30 (bfloat16 vs int8); every simulated fault has a median of 0.14 (noise:0.03) to 1.4
TOLERANCE = 0.25
# gradients drift more: SmolLM2's gradients wrt a span's inputs, as one vector, differ by at most 0.08
# between precisions over 10 blocks and 0.23 over all 30 (bfloat16 vs int8); faults' medians are 0.21
# (noise:0.03) to 1.34, so the subtlest faults are left to the forward checks
GRADIENT_TOLERANCE = 0.5


def deviation(outputs: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[..., T, H] x [..., T, H] -> [..., T]: |outputs - reference| / |reference| per position."""
    outputs, reference = outputs.float(), reference.float()
    return (outputs - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(EPSILON)


def outputs_agree(result: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether hidden states [B, T, H] agree with the reference's at every position (within TOLERANCE)."""
    return first_wrong(result, reference) is None


def gradients_agree(result: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether a backward's gradients agree with the reference's: compared as one vector (a position's
    gradient can be tiny, so positions are not compared alone), within GRADIENT_TOLERANCE."""
    return float(deviation(result.reshape(1, -1), reference.reshape(1, -1))) <= GRADIENT_TOLERANCE


def first_wrong(outputs: torch.Tensor, reference: torch.Tensor) -> int | None:
    """The first position [B, T, H] where any row deviates past TOLERANCE (None: all agree)."""
    wrong = (deviation(outputs, reference) > TOLERANCE).any(dim=0).nonzero()
    return int(wrong[0]) if len(wrong) else None


Run = Callable[[list[Hop]], Awaitable[torch.Tensor]]  # a pass run again on a chain of other servers


class Rewound(Exception):  # noqa: N818 (an event the generation loop handles, not an error)
    """A spot check caught a server of the chain computing wrong outputs from `position` on: the chain was
    repaired (the server replaced) and the session rewound there; what followed must be computed again."""

    def __init__(self, position: int):
        super().__init__(f"rewound to position {position}")
        self.position = position


@dataclass(frozen=True)
class Verdict:
    """A check's outcome: the first wrong position of the checked outputs (None: they are right)."""

    wrong_from: int | None
    faulty: tuple[str, ...] = ()  # servers found faulty (the checked one, its checkers, or both)


@dataclass(frozen=True)
class Dispute:
    """A checked result and its checkers' reference that disagree."""

    hop: Hop  # the checked hop
    result: torch.Tensor
    reference: torch.Tensor
    checkers: list[str]  # the servers that computed the reference
    run: Run  # the same work on another chain of servers
    agree: Callable[[torch.Tensor, torch.Tensor], bool]


class SpotChecker:
    """A client's spot checks: which steps are checked, the checks themselves, and what they found."""

    def __init__(self, swarm: SwarmClient, share: float, seed: int | None = None):
        self.swarm, self.share = swarm, share
        self.window = max(1, round(1 / share)) if share > 0 else 0  # steps per check of each hop
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()  # passed, failed, unchecked (no other server), third opinions
        self.found: dict[str, str] = {}  # peer id -> what a check found
        self._shadows: dict[str, Shadow] = {}  # span session id -> its shadow

    def offsets(self, num_hops: int) -> list[int]:
        """Per hop, the step in each window of `window` steps at which it is checked."""
        return [self.rng.randrange(self.window) for _ in range(num_hops)] if self.window else []

    async def check(self, span: SpanSession) -> Verdict:
        """Check the span session's outputs not yet verified, on its shadow (client/shadows.py)."""
        hop, start, inputs, outputs = span.hop, span.verified, span.inputs, span.outputs
        reference, checkers = await self._shadow_outputs(span, start)
        if reference is None:
            self.counts["unchecked"] += 1
            return Verdict(None)
        result = outputs[:, start:]
        wrong = first_wrong(result, reference)
        if wrong is None:
            self.counts["passed"] += 1
            return Verdict(None)

        async def history(chain: list[Hop]) -> torch.Tensor:  # every position again, as one forward pass
            return (await self._forward(chain, inputs))[:, start:]

        faulty = await self._judge(Dispute(hop, result, reference, checkers, history, outputs_agree))
        return Verdict(start + wrong if hop.peer_id in faulty else None, faulty)

    def draw(self) -> bool:
        """Whether to check this training pass of a hop (each is checked with probability `share`)."""
        return self.share > 0 and self.rng.random() < self.share

    async def check_pass(self, hop: Hop, result: torch.Tensor, run: Run, gradients: bool = False) -> bool:
        """Whether a training pass's `result` of `hop` stands (its outputs [B, T, H], compared per position;
        or its `gradients`, joined into one vector), by running the pass again elsewhere (`run` on a chain of
        other servers over the same blocks). False: its server is faulty (banned for good); redo the pass."""
        reference, checkers = await self._elsewhere(hop, run, {hop.peer_id})
        if reference is None:
            self.counts["unchecked"] += 1
            return True
        agree = gradients_agree if gradients else outputs_agree
        if agree(result, reference):
            self.counts["passed"] += 1
            return True
        return hop.peer_id not in await self._judge(Dispute(hop, result, reference, checkers, run, agree))

    async def _judge(self, dispute: Dispute) -> tuple[str, ...]:
        """More opinions decide who is faulty (`_opinions`); reports and returns the faulty servers."""
        self.counts["third opinions"] += 1
        faulty, hop = await self._opinions(dispute), dispute.hop
        if hop.peer_id not in faulty:  # the checked result is right after all
            self._report(faulty, f"disagreed with two others on blocks {hop.start}:{hop.end}")
        else:
            seen = float(deviation(dispute.result.reshape(1, -1), dispute.reference.reshape(1, -1)))
            self._report(faulty, f"wrong outputs for blocks {hop.start}:{hop.end} (deviation {seen:.3g})")
        return faulty

    async def _opinions(self, dispute: Dispute) -> tuple[str, ...]:
        """Who is faulty, supposing one server of the two chains is (a liar changes every chain it is in).

        A chain of servers outside both decides. Without one (too few replicas), one chain per checker that
        avoids it and the checked server: one that agrees with the checked result convicts the checkers it
        avoided; one that agrees with the reference clears the checker it avoided, and the checked server
        is faulty once every checker is cleared. Undecided, both sides are faulty (the client uses neither).
        """
        hop, checkers, agree, run = dispute.hop, dispute.checkers, dispute.agree, dispute.run
        opinion, _ = await self._elsewhere(hop, run, {hop.peer_id, *checkers})
        if opinion is not None:
            return tuple(checkers) if agree(dispute.result, opinion) else (hop.peer_id,)
        cleared = set()
        for checker in checkers if len(checkers) > 1 else ():
            opinion, servers = await self._elsewhere(hop, run, {hop.peer_id, checker})
            if opinion is not None and agree(dispute.result, opinion):
                return tuple(c for c in checkers if c not in servers)
            if opinion is not None and agree(dispute.reference, opinion):
                cleared.add(checker)
        return (hop.peer_id,) if cleared == set(checkers) else (hop.peer_id, *checkers)

    async def check_spans(
        self, spans: list[SpanSession], due: list[bool]
    ) -> AsyncIterator[tuple[int, Verdict]]:
        """Check the span sessions that are `due` (their outputs not yet verified); yields (index, verdict)
        for each verdict that found a server faulty. A span whose outputs pass is verified up to its end."""
        for index, span in enumerate(spans):
            if not due[index] or span.outputs is None or span.verified >= span.outputs.shape[1]:
                continue
            checked = span.outputs.shape[1]
            verdict = await self.check(span)
            if span.hop.peer_id not in verdict.faulty:
                span.verified = checked
            if verdict.faulty:
                yield index, verdict

    async def _shadow_outputs(self, span: SpanSession, start: int) -> tuple[torch.Tensor | None, list[str]]:
        """The shadow's outputs for the span's positions [start, T), and its servers (None: no shadow)."""
        shadow = self._shadows.get(span.session_id)
        if shadow is not None and any(peer in self.swarm.banned() for peer in shadow.peers):
            await self.release([span])
            shadow = None
        if shadow is None:
            shadow = await open_shadow(self.swarm, span)
            if shadow is None:
                return None, []
            self._shadows[span.session_id] = shadow
        try:
            return await shadow.outputs(span.inputs, start), shadow.peers
        except RETRYABLE as e:
            logger.info("A spot check of ...%s could not run: %s", span.hop.peer_id[-6:], e)
            await self.release([span])
            return None, []

    async def release(self, spans: list[SpanSession]) -> None:
        """Close the shadows of these span sessions (they ended, or their server was replaced)."""
        shadows = [self._shadows.pop(span.session_id, None) for span in spans]
        await asyncio.gather(*(shadow.close() for shadow in shadows if shadow is not None))

    async def _elsewhere(self, hop: Hop, run: Run, avoid: set[str]) -> tuple[torch.Tensor | None, list[str]]:
        """`run` on a chain of servers over blocks [hop.start, hop.end), none in `avoid` (None: no such
        chain now, or it failed), and those servers."""
        try:
            chain = await self.swarm.route(hop.start, hop.end, avoid=avoid, wait=False)
        except MissingBlocks as e:
            logger.info("No other servers to check ...%s on: %s", hop.peer_id[-6:], e)
            return None, []
        try:
            result = await run(chain)
        except (*RETRYABLE, CorollaError) as e:
            logger.warning("A spot check of ...%s could not run: %s", hop.peer_id[-6:], e)
            return None, []
        return result, [link.peer_id for link in chain]

    async def _forward(self, chain: list[Hop], hidden: torch.Tensor) -> torch.Tensor:
        swarm = self.swarm
        for link in chain:
            hidden = await remote_forward(
                swarm.p2p,
                link,
                swarm.dht_prefix,
                hidden,
                swarm.config.request_timeout,
                adapter=swarm.config.active_adapter,
            )
        return hidden

    def _report(self, peers: tuple[str, ...] | list[str], what: str) -> None:
        for peer_id in peers:
            self.counts["failed"] += 1
            self.found[peer_id] = what
            self.swarm.ban_for_good(peer_id, what)
