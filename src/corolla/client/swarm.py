"""The swarm as chains, passes and checks reach it: the client's objects that know the servers.

`Swarm` holds them together; it has no logic of its own. The client (client/client.py) builds one, on
the libp2p network or, in tests, on an in-process transport.
"""

from __future__ import annotations

from dataclasses import dataclass

from corolla.client.bans import Bans
from corolla.client.estimates import ServerEstimates
from corolla.client.peers import Peers
from corolla.client.router import Router
from corolla.client.swarm_view import SwarmView
from corolla.config import ClientConfig


@dataclass(frozen=True)
class Swarm:
    config: ClientConfig
    num_blocks: int
    peers: Peers  # how to talk to a server
    view: SwarmView  # who serves what
    bans: Bans  # whom to avoid
    estimates: ServerEstimates  # how fast each server is, and this client's load on it
    router: Router  # the cheapest chain of routable servers
