"""Pinging a server: one `rpc_info` round trip, which also returns its live load.

Used by clients (to weigh servers when routing) and by servers (to measure the links to the servers that
take their outputs, which they announce for push-aware routing).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.errors import NotAllowed, decode_remote_error
from corolla.swarm.nat.circuit_book import BOOK
from corolla.swarm.p2p.transport import Transport
from corolla.wire.messages import RPC_INFO
from corolla.wire.records import ServerStatus


@dataclass(frozen=True)
class Ping:
    """A ping's outcome: the round trip and the server's report when it answered; why it refused this
    peer when it is a private swarm's server that does not allow it."""

    seconds: float | None = None
    status: ServerStatus | None = None
    refusal: str | None = None

    @property
    def answered(self) -> bool:
        return self.status is not None


async def fetch_status(transport: Transport, peer_id: str, timeout: float) -> ServerStatus:
    """A server's own report (rpc_info); raises what the call raises (the transport's errors, a timeout,
    or InvalidRequest for a garbled reply)."""
    request = runtime_pb2.ExpertUID(uid="")
    reply = await asyncio.wait_for(
        transport.call(peer_id, RPC_INFO, request, runtime_pb2.ExpertInfo), timeout
    )
    status = ServerStatus.from_bytes(reply.serialized_info)
    BOOK.learn(peer_id, status.relays)  # its relays now (swarm/nat/circuit_book.py)
    return status


async def ping(transport: Transport, peer_id: str, timeout: float) -> Ping:
    """A server's report and the round trip, or no answer (unreachable, dead, timed out, garbled)."""
    started = time.perf_counter()
    try:
        status = await fetch_status(transport, peer_id, timeout)
    except P2PHandlerError as e:
        error = decode_remote_error(str(e))
        return Ping(refusal=error.message if isinstance(error, NotAllowed) else None)
    except Exception:  # unreachable, dead, timed out or a garbled reply: all mean "no answer"
        return Ping()
    return Ping(time.perf_counter() - started, status)
