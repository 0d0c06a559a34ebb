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
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import AsyncIterator
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


def deviation(outputs: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[..., T, H] x [..., T, H] -> [..., T]: |outputs - reference| / |reference| per position."""
    outputs, reference = outputs.float(), reference.float()
    return (outputs - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(EPSILON)


def first_wrong(outputs: torch.Tensor, reference: torch.Tensor) -> int | None:
    """The first position [B, T, H] where any row deviates past TOLERANCE (None: all agree)."""
    wrong = (deviation(outputs, reference) > TOLERANCE).any(dim=0).nonzero()
    return int(wrong[0]) if len(wrong) else None


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
        wrong = first_wrong(outputs[:, start:], reference)
        if wrong is None:
            self.counts["passed"] += 1
            return Verdict(None)
        self.counts["third opinions"] += 1
        third, _ = await self._recompute(hop, inputs, {hop.peer_id, *checkers})
        if third is not None and first_wrong(outputs[:, start:], third[:, start:]) is None:
            self._report(checkers, f"disagreed with two others on blocks {hop.start}:{hop.end}")
            return Verdict(None, tuple(checkers))  # the checked outputs are right after all
        # the checked server disagrees with every other opinion; with no third one, both sides are out
        faulty = (hop.peer_id,) if third is not None else (hop.peer_id, *checkers)
        seen = float(deviation(outputs[:, start:], reference).max())
        self._report(faulty, f"wrong outputs for blocks {hop.start}:{hop.end} (deviation {seen:.3g})")
        return Verdict(start + wrong, faulty)

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

    async def _recompute(
        self, hop: Hop, inputs: torch.Tensor, avoid: set[str]
    ) -> tuple[torch.Tensor | None, list[str]]:
        """The outputs of blocks [hop.start, hop.end) for `inputs` on servers not in `avoid` (None: no
        such chain now, or it failed), and those servers."""
        try:
            chain = await self.swarm.route(hop.start, hop.end, avoid=avoid, wait=False)
        except MissingBlocks as e:
            logger.warning("No other servers to check ...%s on: %s", hop.peer_id[-6:], e)
            return None, []
        hidden, config = inputs, self.swarm.config
        try:
            for link in chain:
                hidden = await remote_forward(
                    self.swarm.p2p, link, self.swarm.dht_prefix, hidden, config.request_timeout
                )
        except (*RETRYABLE, CorollaError) as e:
            logger.warning("A spot check of ...%s could not run: %s", hop.peer_id[-6:], e)
            return None, []
        return hidden, [link.peer_id for link in chain]

    def _report(self, peers: tuple[str, ...] | list[str], what: str) -> None:
        for peer_id in peers:
            self.counts["failed"] += 1
            self.found[peer_id] = what
            self.swarm.ban_for_good(peer_id, what)
