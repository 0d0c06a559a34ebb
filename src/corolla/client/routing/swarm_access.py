"""The swarm as chains, passes and checks reach it: the client's objects that know the servers.

`SwarmAccess` holds them together; it has no logic of its own. The client (client/client.py) builds one, on
the libp2p network or, in tests, on an in-process transport.
"""

from __future__ import annotations

from dataclasses import dataclass

from corolla.client.routing.bans import Bans
from corolla.client.routing.estimates import ServerEstimates
from corolla.client.routing.router import Router
from corolla.client.routing.swarm_view import SwarmView
from corolla.client.rpc.peers import Peers
from corolla.config import ClientConfig


@dataclass(frozen=True)
class SwarmAccess:
    config: ClientConfig
    num_blocks: int
    peers: Peers  # how to talk to a server
    view: SwarmView  # who serves what
    bans: Bans  # whom to avoid
    estimates: ServerEstimates  # how fast each server is, and this client's load on it
    router: Router  # the cheapest chain of routable servers
