"""Pinging a server: one `rpc_info` round trip, which also returns its live load.

Used by clients (to weigh servers when routing) and by servers (to measure the links to the servers that
take their outputs, which they announce for push-aware routing).
"""

from __future__ import annotations

import asyncio
import time

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.errors import NotAllowed, decode_remote_error
from corolla.wire.messages import RPC_INFO
from corolla.wire.records import ServerStatus


async def fetch_status(p2p: P2P, peer_id: str, timeout: float) -> ServerStatus:
    """A server's own report (rpc_info); raises what the call raises (hivemind's errors, a timeout, or
    InvalidRequest for a garbled reply)."""
    reply = await asyncio.wait_for(
        p2p.call_protobuf_handler(
            PeerID.from_base58(peer_id), RPC_INFO, runtime_pb2.ExpertUID(uid=""), runtime_pb2.ExpertInfo
        ),
        timeout,
    )
    return ServerStatus.from_bytes(reply.serialized_info)


async def ping(
    p2p: P2P, peer_id: str, timeout: float, refusals: dict[str, str] | None = None
) -> tuple[float, ServerStatus] | None:
    """(round-trip seconds, the server's report), or None if it did not answer properly in time. A private
    swarm's server that refuses this peer (NotAllowed) gets its reason noted in `refusals`."""
    started = time.perf_counter()
    try:
        status = await fetch_status(p2p, peer_id, timeout)
    except P2PHandlerError as e:
        if refusals is not None and isinstance(error := decode_remote_error(str(e)), NotAllowed):
            refusals[peer_id] = error.message
        return None
    except Exception:  # unreachable, dead, timed out or a garbled reply: all mean "no answer"
        return None
    if refusals is not None:
        refusals.pop(peer_id, None)
    return time.perf_counter() - started, status
