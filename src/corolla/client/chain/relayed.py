"""Servers behind NAT as a chain sees them: reached through relays, which end a relayed connection at their
limits (time, and data each way). A connection the relay cut is not the server's fault: the client
connects again at once and replays, without a ban (`relay_cut`). Better still, it makes the connection
anew before the limit (`relay_limit_ahead`, from the limits the server's record announces:
swarm/nat/circuit_book.py), so that no step is cut halfway.
"""

from __future__ import annotations

import logging

import torch

from corolla.client.routing.swarm_access import SwarmAccess
from corolla.errors import ConnectionLost

logger = logging.getLogger(__name__)


def relay_cut(swarm: SwarmAccess, peer_id: str, error: Exception) -> bool:
    """Whether `error` is a lost connection to a server reached only through relays (by its record)."""
    status = swarm.view.status_of(peer_id)
    return isinstance(error, ConnectionLost) and status is not None and status.reachability == "relayed"


async def relay_limit_ahead(swarm: SwarmAccess, peer_id: str, hidden: torch.Tensor) -> bool:
    """Whether sending `hidden` to `peer_id` would come close to a limit of the relay between them: the
    connection is then closed (the caller replays the session on a new one) and the move said."""
    nbytes = hidden.numel() * hidden.element_size()
    reason = await swarm.peers.transport.limit_ahead(peer_id, nbytes)
    if reason is not None:
        logger.info("Moving the session on server ...%s to a new connection: %s", peer_id[-6:], reason)
    return reason is not None
