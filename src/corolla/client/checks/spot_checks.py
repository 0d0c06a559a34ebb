"""Spot checks: a share of a server's work re-run elsewhere and compared, to catch servers that lie.

Inference: between two rounds of a generation (never with a token tree pending), each hop of the chain
is checked at one random step in every window of 1/share steps, and every hop once more when a
generation ends. A check sends what the hop computed since its last check to a shadow chain on other
servers (client/checks/shadow.py) and compares the outputs not yet verified (client/checks/compare.py).
Outputs that disagree go to the judge (client/checks/disputes.py). A check returns a `Verdict` when a server
of the session's chain is faulty: where the session must go back to, and which servers to replace. The checker
never changes a session itself; the generation loop repairs it and decides what the withdrawn tokens mean.

Training passes (client/training/remote_chain.py) are checked the same way, each hop's forward and backward
with probability `share`: the pass is run again on other servers and its result compared.
"""

from __future__ import annotations

import asyncio
import logging
import random
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch

from corolla.client.chain.hop_passes import forward_along
from corolla.client.chain.opening import Link
from corolla.client.chain.session import InferenceSession
from corolla.client.checks.compare import first_change, first_wrong, gradients_agree, outputs_agree
from corolla.client.checks.disputes import Dispute, Judge, Run
from corolla.client.checks.shadow import Shadow
from corolla.client.routing.swarm_access import SwarmAccess
from corolla.errors import RETRYABLE, MissingBlocks
from corolla.swarm.policy.routing import Hop

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """Servers of a session's chain found faulty, and the first position any of them may have got wrong."""

    position: int
    faulty: tuple[str, ...]


@dataclass
class _Verified:
    """A hop's history as it was when its outputs passed a check (positions before a change still count)."""

    inputs: torch.Tensor
    outputs: torch.Tensor

    def length(self, link: Link) -> int:
        history = link.history
        return min(first_change(self.inputs, history.inputs), first_change(self.outputs, history.outputs))


@dataclass
class _SessionChecks:
    """One session's checks: its steps so far, each hop's step in a window, what passed, the shadows."""

    steps: int = 0
    offsets: list[int] = field(default_factory=list)
    verified: dict[str, _Verified] = field(default_factory=dict)  # by the hop's stream session id
    shadows: dict[str, Shadow] = field(default_factory=dict)

    def verified_length(self, link: Link) -> int:
        verified = self.verified.get(link.stream.session_id)
        return 0 if verified is None else verified.length(link)

    async def release(self, keep: set[str] = frozenset()) -> None:
        """Close the shadows of hops not in `keep` (replaced, or the session ended)."""
        gone = [key for key in self.shadows if key not in keep]
        closing = [self.shadows.pop(key).close() for key in gone]
        await asyncio.gather(*closing, return_exceptions=True)


class SpotChecker:
    """A client's spot checks: which steps are checked, the checks themselves, and what they found."""

    def __init__(self, swarm: SwarmAccess, share: float, seed: int | None = None):
        self.swarm = swarm
        self.share = share
        self.window = max(1, round(1 / share)) if share > 0 else 0  # steps per check of each hop
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()  # passed, failed, unchecked (no other server), third opinions
        self.judge = Judge(swarm, self.counts)
        if swarm is not None:
            swarm.bans.settle_disputes = self.judge.settle  # the router tries when blocks are missing
        self._sessions: weakref.WeakKeyDictionary[InferenceSession, _SessionChecks] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def found(self) -> dict[str, str]:
        return self.judge.found

    def offsets(self, num_hops: int) -> list[int]:
        """Per hop, the step in each window of `window` steps at which it is checked."""
        return [self.rng.randrange(self.window) for _ in range(num_hops)] if self.window else []

    async def check(self, session: InferenceSession, every_hop: bool = False) -> Verdict | None:
        """Check the hops due at this round (each once per window of rounds), or `every_hop`; a verdict
        when a server of the session's chain is faulty."""
        state = self._state(session)
        await self.judge.settle()
        if session.has_pending_tree:
            return None
        links = session.chain.links
        if len(state.offsets) != len(links):
            state.offsets = self.offsets(len(links))
        await state.release({link.stream.session_id for link in links})  # shadows of replaced hops
        due = [every_hop or state.steps % self.window == offset for offset in state.offsets]
        state.steps += 1
        for link, is_due in zip(links, due, strict=True):
            faulty, wrong_from = await self._check_link(session, state, link) if is_due else ((), None)
            chain_faulty = tuple(hop.peer_id for hop in session.route if hop.peer_id in faulty)
            if chain_faulty:
                return Verdict(
                    self._rewind_position(state, links, link, chain_faulty, wrong_from), chain_faulty
                )
        return None

    def _state(self, session: InferenceSession) -> _SessionChecks:
        state = self._sessions.get(session)
        if state is None:
            state = self._sessions[session] = _SessionChecks()
            session.close_with(state.release)
        return state

    @staticmethod
    def _rewind_position(
        state: _SessionChecks,
        links: list[Link],
        checked: Link,
        faulty: tuple[str, ...],
        wrong_from: int | None,
    ) -> int:
        """The first position a faulty server of the chain may have got wrong: the checked hop's first wrong
        one, another faulty hop's first not verified."""
        starts = [
            wrong_from if link is checked and wrong_from is not None else state.verified_length(link)
            for link in links
            if link.hop.peer_id in faulty
        ]
        return min(starts)

    async def _check_link(
        self, session: InferenceSession, state: _SessionChecks, link: Link
    ) -> tuple[tuple[str, ...], int | None]:
        """Check a hop's outputs not yet verified: (the servers found faulty, its first wrong position)."""
        history = link.history
        start = state.verified_length(link)
        if history.outputs is None or start >= history.length:
            return (), None
        inputs = history.inputs
        outputs = history.outputs
        reference, checkers = await self._shadow_outputs(session, state, link, start)
        if reference is None:
            self.counts["unchecked"] += 1
            return (), None
        result = outputs[:, start:]
        wrong = first_wrong(result, reference)
        if wrong is None:
            self.counts["passed"] += 1
            state.verified[link.stream.session_id] = _Verified(inputs, outputs)
            return (), None

        async def history_again(chain: list[Hop]) -> torch.Tensor:  # every position, as one forward pass
            return (await forward_along(self.swarm, chain, inputs))[:, start:]

        dispute = Dispute(link.hop, result, reference, checkers, history_again, outputs_agree)
        faulty = await self.judge.judge(dispute)
        if link.hop.peer_id not in faulty:
            state.verified[link.stream.session_id] = _Verified(inputs, outputs)
        return faulty, start + wrong

    async def _shadow_outputs(
        self, session: InferenceSession, state: _SessionChecks, link: Link, start: int
    ) -> tuple[torch.Tensor | None, list[str]]:
        """The shadow's outputs for the hop's positions [start, T), and its servers (None: no shadow)."""
        key = link.stream.session_id
        shadow = state.shadows.get(key)
        if shadow is not None and any(peer in self.swarm.bans.banned() for peer in shadow.peers):
            await state.release(set(state.shadows) - {key})
            shadow = None
        try:
            if shadow is None:
                shadow = state.shadows[key] = await Shadow.open(self.swarm, link, session.max_length)
            return await shadow.outputs(link.history.inputs, start), shadow.peers
        except (*RETRYABLE, MissingBlocks) as e:
            logger.info("A spot check of ...%s could not run: %s", link.hop.peer_id[-6:], e)
            await state.release(set(state.shadows) - {key})
            return None, []

    # --- training passes ----------------------------------------------------------------------------------

    def draw(self) -> bool:
        """Whether to check this training pass of a hop (each is checked with probability `share`)."""
        return self.share > 0 and self.rng.random() < self.share

    async def check_pass(self, hop: Hop, result: torch.Tensor, run: Run, gradients: bool = False) -> bool:
        """Whether a training pass's `result` of `hop` stands (its outputs [B, T, H], compared per position;
        or its `gradients`, joined into one vector), by running the pass again elsewhere (`run` on a chain of
        other servers over the same blocks). False: its server is faulty (banned for good); redo the pass."""
        reference, checkers = await self.judge.elsewhere(hop, run, {hop.peer_id})
        if reference is None:
            self.counts["unchecked"] += 1
            return True
        agree = gradients_agree if gradients else outputs_agree
        if agree(result, reference):
            self.counts["passed"] += 1
            return True
        return hop.peer_id not in await self.judge.judge(
            Dispute(hop, result, reference, checkers, run, agree)
        )
