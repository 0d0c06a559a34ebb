"""Noticing a silent hop: a frozen server would otherwise stall its streams until the request timeout.

A decode step unanswered for `limit` seconds (client/routing/estimates.py `silence_limit`: a few times the
server's recent decode steps, and at least a second) gets a ping (rpc_info, answered by the server's event
loop, not its compute). A server that answers is busy, not frozen: the step waits on, and is pinged again
after each further `limit` (a machine can hang after it answered). One that misses a ping (`probe`
seconds: estimates.py `probe_timeout`) counts as failed (SessionTimeout), and the chain replaces it as it
replaces a dead one. So a frozen server stalls a stream for about `limit + probe` seconds, not for the
request timeout; a false alarm costs one ping.

A server can also answer pings while its compute is stuck (a hung GPU driver or engine thread, or a peer
that takes sessions and never computes): its pings report the engine passes it has run (ServerStatus
`engine_passes`). One that runs no pass while the step waits, for STUCK_LIMITS limits and at least
STUCK_FLOOR seconds, counts as failed too: a server with work runs passes, and this step is work. The
margin is wide (16 limits: 48 of its slowest recent decode steps) because one pass of another session's
prefill (128 tokens by default, compute-bound on a CPU) may take many decode steps' time.
Counting its own passes is all a peer can lie about here; a liar is left to spot checks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

from corolla.errors import SessionTimeout
from corolla.swarm.p2p.ping import Ping, ping
from corolla.swarm.p2p.transport import Transport
from corolla.wire.records import ServerStatus

T = TypeVar("T")

STUCK_LIMITS = 16  # silence limits without a pass before a server answering pings counts as stuck
STUCK_FLOOR = 10.0  # seconds, at least


async def unless_silent(
    work: Awaitable[T], limit: float | None, probe: float, transport: Transport, peer_id: str
) -> T:
    """`work` (a step on `peer_id`'s server); SessionTimeout if it is silent for `limit` seconds and then
    misses a ping that may take `probe` seconds. `limit` None: no limit here (the request timeout applies)."""
    task = asyncio.ensure_future(work)
    try:
        if limit is None:
            return await task
        progress = _Progress(max(STUCK_FLOOR, STUCK_LIMITS * limit))
        while True:
            done, _ = await asyncio.wait({task}, timeout=limit)
            if task in done:
                return task.result()
            answer = await _answer(task, transport, peer_id, probe)
            if task.done():
                return task.result()
            if answer is None or not answer.answered:
                silent = f"said nothing for {limit:.1f}s and missed a ping"
                raise SessionTimeout(f"server ...{peer_id[-6:]} {silent}")
            if progress.stuck(answer.status):
                stuck = f"answers pings but ran no pass for {progress.waited:.0f}s with this step waiting"
                raise SessionTimeout(f"server ...{peer_id[-6:]} {stuck}")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _answer(task: asyncio.Future, transport: Transport, peer_id: str, probe: float) -> Ping | None:
    """The server's answer to a ping within `probe` seconds (None: `task` ended first)."""
    pinging = asyncio.ensure_future(ping(transport, peer_id, probe))
    try:
        await asyncio.wait({task, pinging}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not pinging.done():
            pinging.cancel()
            await asyncio.gather(pinging, return_exceptions=True)
    return None if pinging.cancelled() else pinging.result()


class _Progress:
    """Whether a server that answers pings has run no engine pass for `patience` seconds while a step
    waits there (by its own reports)."""

    def __init__(self, patience: float):
        self.patience = patience
        self.passes: int | None = None
        self.since = time.monotonic()  # when its pass count last moved (or was first seen)
        self.waited = 0.0

    def stuck(self, status: ServerStatus) -> bool:
        now = time.monotonic()
        if status.engine_passes != self.passes:
            self.passes = status.engine_passes
            self.since = now
        self.waited = now - self.since
        return self.waited >= self.patience
