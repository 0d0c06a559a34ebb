"""Noticing a silent hop: a frozen server would otherwise stall its streams until the request timeout.

A decode step unanswered for `limit` seconds (client/routing/estimates.py `silence_limit`: a few times the
server's recent decode steps, and at least a second) gets a ping (rpc_info, answered by the server's event
loop, not its compute). A server that answers is busy, not frozen: the step waits on, and is pinged again
after each further `limit` (a machine can hang after it answered). One that misses a ping (`probe`
seconds: estimates.py `probe_timeout`) counts as failed (SessionTimeout), and the chain replaces it as it
replaces a dead one. So a frozen server stalls a stream for about `limit + probe` seconds, not for the
request timeout; a false alarm costs one ping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from corolla.errors import SessionTimeout
from corolla.swarm.p2p.ping import ping
from corolla.swarm.p2p.transport import Transport

T = TypeVar("T")


async def unless_silent(
    work: Awaitable[T], limit: float | None, probe: float, transport: Transport, peer_id: str
) -> T:
    """`work` (a step on `peer_id`'s server); SessionTimeout if it is silent for `limit` seconds and then
    misses a ping that may take `probe` seconds. `limit` None: no limit here (the request timeout applies)."""
    task = asyncio.ensure_future(work)
    try:
        if limit is None:
            return await task
        while True:
            done, _ = await asyncio.wait({task}, timeout=limit)
            if task in done:
                return task.result()
            if not await _answers(task, transport, peer_id, probe):
                silent = f"said nothing for {limit:.1f}s and missed a ping"
                raise SessionTimeout(f"server ...{peer_id[-6:]} {silent}")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _answers(task: asyncio.Future, transport: Transport, peer_id: str, probe: float) -> bool:
    """Whether the server answered a ping (or `task` ended) within `probe` seconds."""
    pinging = asyncio.ensure_future(ping(transport, peer_id, probe))
    try:
        await asyncio.wait({task, pinging}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not pinging.done():
            pinging.cancel()
            await asyncio.gather(pinging, return_exceptions=True)
    return task.done() or pinging.result().answered
