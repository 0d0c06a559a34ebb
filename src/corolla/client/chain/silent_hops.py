"""Steps watched for a silent server (client/rpc/stall_probe.py), with the pace this client measured.

A decode step, or a frame of pipelined speculation, may go unanswered for the server's `silence_limit`
(client/routing/estimates.py) before the server is pinged, and the ping may take its `probe_timeout`. A
server found silent while frames were in flight (client/chain/frames.py, which replaces no server) is
remembered: the chain's next step to it fails at once, and the chain replaces it, instead of waiting out
the silence a second time.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from corolla.client.routing.swarm_access import SwarmAccess
from corolla.client.rpc.stall_probe import unless_silent
from corolla.errors import SessionTimeout

T = TypeVar("T")

PACED_TOKENS = 64  # a step of at most this many tokens a row (a decode step, a draft tree, a frame) is paced


class SilentHops:
    def __init__(self, swarm: SwarmAccess):
        self.swarm = swarm
        self._found: set[str] = set()  # servers that missed a ping during frames, not yet replaced

    async def watch(
        self, work: Callable[[], Awaitable[T]], peer_id: str, paced: bool, frame: bool = False
    ) -> T:
        """`work()` (a step on `peer_id`'s server; `paced`: of at most PACED_TOKENS tokens a row, whose time
        the server's recent ones foretell); SessionTimeout if the server is silent (`frame`: remembered until
        the chain's next step to it). A paced step's round trip, pushed or not, joins the server's pace."""
        if peer_id in self._found:
            self._found.discard(peer_id)
            raise SessionTimeout(f"server ...{peer_id[-6:]} missed a ping while frames were in flight")
        estimates = self.swarm.estimates
        limit = estimates.silence_limit(peer_id) if paced else None
        probe = estimates.probe_timeout(peer_id)
        started = time.perf_counter()
        try:
            result = await unless_silent(work(), limit, probe, self.swarm.peers.transport, peer_id)
        except SessionTimeout:
            if frame:
                self._found.add(peer_id)
            raise
        if paced:
            estimates.replied(peer_id, time.perf_counter() - started)
        return result
