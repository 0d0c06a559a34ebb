"""Noticing a silent hop: a frozen server would otherwise stall its streams until the request timeout.

A decode step unanswered for `limit` seconds (client/routing/estimates.py `silence_limit`: several times the
server's recent decode steps, and at least a couple of seconds) gets a ping (rpc_info, answered by the
server's event loop, not its compute). A server that answers is busy, not frozen: the step waits on, up
to the request timeout. One that does not answer within the probe time counts as failed (SessionTimeout),
and the chain replaces it as it replaces a dead one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from corolla.errors import SessionTimeout
from corolla.swarm.p2p.ping import ping
from corolla.swarm.p2p.transport import Transport

T = TypeVar("T")

PROBE_TIMEOUT = 1.5  # seconds a silent server's ping may take before it counts as frozen


async def unless_silent(work: Awaitable[T], limit: float | None, transport: Transport, peer_id: str) -> T:
    """`work` (a step on `peer_id`'s server); SessionTimeout if it is silent for `limit` seconds and then
    misses a ping. `limit` None: no limit here (the request timeout applies)."""
    task = asyncio.ensure_future(work)
    try:
        if limit is None:
            return await task
        done, _ = await asyncio.wait({task}, timeout=limit)
        if task in done:
            return task.result()
        probe = asyncio.ensure_future(ping(transport, peer_id, PROBE_TIMEOUT))
        try:
            await asyncio.wait({task, probe}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not probe.done():
                probe.cancel()
                await asyncio.gather(probe, return_exceptions=True)
        if task.done() or probe.result().answered:
            return await task  # answered, or busy but alive: it has the request timeout
        raise SessionTimeout(f"server ...{peer_id[-6:]} said nothing for {limit:.1f}s and missed a ping")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
