"""Relays of simulated servers behind routers: each keeps a reservation on a random reachable server or on
the bootstrap peer, as corolla's servers do (swarm/nat/), for as long as that peer lives."""

from __future__ import annotations

import random

from corolla.sim.network import Network
from corolla.sim.state import SimServer

BOOTSTRAP = "bootstrap"  # a public peer relaying for servers behind routers, as servers do


class Relays:
    def __init__(self, network: Network, servers: dict[str, SimServer], rng: random.Random):
        self.network = network
        self.servers = servers
        self.rng = rng
        self.public: list[str] = []  # servers not behind a router (possible relays), the dead dropped lazily
        network.place(BOOTSTRAP)

    def reserve(self, server: SimServer) -> None:
        """A reservation for `server` if it is behind a router and has none on a live peer."""
        peer = self.network.peers[server.peer_id]
        if not peer.behind_nat or (peer.relay is not None and self.relays(peer.relay)):
            return
        while True:  # the public servers that joined, the dead among them dropped as they are drawn
            index = self.rng.randrange(len(self.public) + 1)
            if index == len(self.public):
                peer.relay = BOOTSTRAP
                return
            if self.relays(self.public[index]):
                peer.relay = self.public[index]
                return
            self.public[index] = self.public[-1]
            self.public.pop()

    def relays(self, peer_id: str) -> bool:
        return peer_id == BOOTSTRAP or self.servers[peer_id].alive
