"""Deciding who is faulty when a checked result and its checkers' reference disagree.

More opinions decide, supposing one server among those compared is lying (a liar changes every chain it
is in): the same work run on a chain of servers outside both sides; with too few replicas for that, one
chain per checker that avoids it and the checked server. The servers found faulty are banned for good
(client/routing/bans.py) and counted. A dispute no other server can settle accuses no one: this client avoids
both sides (`Undecided`) and judges it again once the swarm has changed (`settle`), as a server of those
blocks, or servers of parts of them, may have joined.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from corolla.client.checks.compare import deviation
from corolla.client.routing.bans import Undecided
from corolla.client.routing.swarm_access import SwarmAccess
from corolla.errors import RETRYABLE, CorollaError, MissingBlocks
from corolla.swarm.policy.routing import Hop

logger = logging.getLogger(__name__)

Run = Callable[[list[Hop]], Awaitable[torch.Tensor]]  # the work run again on a chain of other servers
Agree = Callable[[torch.Tensor, torch.Tensor], bool]


@dataclass(frozen=True)
class Dispute:
    """A checked result and its checkers' reference that disagree."""

    hop: Hop  # the checked hop
    result: torch.Tensor
    reference: torch.Tensor
    checkers: list[str]  # the servers that computed the reference
    run: Run  # the same work on another chain of servers
    agree: Agree


class Judge:
    def __init__(self, swarm: SwarmAccess, counts: Counter[str]):
        self.swarm = swarm
        self.counts = counts  # the spot checker's: failed, third opinions
        self.found: dict[str, str] = {}  # peer id -> what a check found
        self.pending: dict[Undecided, Dispute] = {}  # disputes no server could settle yet
        self._settled_at = 0.0  # when the swarm view was read at the last try to settle them

    async def elsewhere(self, hop: Hop, run: Run, avoid: set[str]) -> tuple[torch.Tensor | None, list[str]]:
        """`run` on a chain of servers over blocks [hop.start, hop.end), none in `avoid` (None: no such
        chain now, or it failed), and those servers."""
        try:
            chain = await self.swarm.router.route(hop.start, hop.end, avoid=avoid, wait=False)
        except MissingBlocks as e:
            logger.info("No other servers to check ...%s on: %s", hop.peer_id[-6:], e)
            return None, []
        try:
            result = await run(chain)
        except (*RETRYABLE, CorollaError) as e:
            logger.warning("A spot check of ...%s could not run: %s", hop.peer_id[-6:], e)
            return None, []
        return result, [link.peer_id for link in chain]

    async def judge(self, dispute: Dispute) -> tuple[str, ...]:
        """More opinions decide who is faulty (`opinions`); reports and returns the faulty servers.
        Undecided: both sides, avoided by this client but not reported."""
        self.counts["third opinions"] += 1
        hop = dispute.hop
        faulty = await self.opinions(dispute)
        if faulty is None:
            undecided = Undecided(hop.peer_id, tuple(dispute.checkers), hop.start, hop.end)
            self.counts["undecided"] += 1
            self.pending[undecided] = dispute
            self.swarm.bans.dispute(undecided)
            return undecided.peers
        self._convict(dispute, faulty)
        return faulty

    async def settle(self) -> None:
        """Judge the undecided disputes again on a chain of servers outside both sides, if the swarm was
        read again since the last try (servers of those blocks may have joined)."""
        if not self.pending or self.swarm.view.refreshed_at == self._settled_at:
            return
        self._settled_at = self.swarm.view.refreshed_at
        for undecided, dispute in list(self.pending.items()):
            opinion, _ = await self.elsewhere(dispute.hop, dispute.run, set(undecided.peers))
            if opinion is None:
                continue
            del self.pending[undecided]
            self.swarm.bans.settle(undecided)
            self.counts["undecided"] -= 1
            faulty = undecided.checkers if dispute.agree(dispute.result, opinion) else (undecided.checked,)
            logger.info("Settled %s: ...%s lied", undecided.describe(), " ...".join(p[-6:] for p in faulty))
            self._convict(dispute, faulty)

    def _convict(self, dispute: Dispute, faulty: tuple[str, ...]) -> None:
        hop = dispute.hop
        if hop.peer_id not in faulty:  # the checked result is right after all
            self._report(faulty, f"disagreed with two others on blocks {hop.start}:{hop.end}")
        else:
            seen = float(deviation(dispute.result.reshape(1, -1), dispute.reference.reshape(1, -1)))
            self._report(faulty, f"wrong outputs for blocks {hop.start}:{hop.end} (deviation {seen:.3g})")

    async def opinions(self, dispute: Dispute) -> tuple[str, ...] | None:
        """Who is faulty, supposing one server of the two chains is.

        A chain of servers outside both decides. Without one (too few replicas), one chain per checker that
        avoids it and the checked server: one that agrees with the checked result convicts the checkers it
        avoided; one that agrees with the reference clears the checker it avoided, and the checked server
        is faulty once every checker is cleared. None: undecided.
        """
        hop = dispute.hop
        checkers = dispute.checkers
        agree = dispute.agree
        run = dispute.run
        opinion, _ = await self.elsewhere(hop, run, {hop.peer_id, *checkers})
        if opinion is not None:
            return tuple(checkers) if agree(dispute.result, opinion) else (hop.peer_id,)
        cleared = set()
        for checker in checkers if len(checkers) > 1 else ():
            opinion, servers = await self.elsewhere(hop, run, {hop.peer_id, checker})
            if opinion is not None and agree(dispute.result, opinion):
                return tuple(c for c in checkers if c not in servers)
            if opinion is not None and agree(dispute.reference, opinion):
                cleared.add(checker)
        return (hop.peer_id,) if cleared == set(checkers) else None

    def _report(self, peers: tuple[str, ...] | list[str], what: str) -> None:
        for peer_id in peers:
            self.counts["failed"] += 1
            self.found[peer_id] = what
            self.swarm.bans.ban_for_good(peer_id, what)
