"""What the simulated swarm's parts share: a server as the simulation tracks it, and the swarm as
clients and sessions see it (sim/swarm.py's Simulation is one)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from corolla.server.placement import Placed
from corolla.sim.network import Network
from corolla.sim.scenario import Scenario, ServerClass


@dataclass(eq=False)
class SimServer:
    peer_id: str
    kind: ServerClass
    blocks: int  # how many it holds
    throughput: float  # announced: its true speed, off by up to the scenario's noise
    start: int = 0
    end: int = 0
    alive: bool = True
    leaving: bool = False  # announced OFFLINE, serving its open sessions until the drain timeout
    links: dict[str, float] = field(default_factory=dict)  # round trips to servers after it, announced
    sessions: int = 0  # open sessions with a hop here


class Swarm(Protocol):
    scenario: Scenario
    now: float
    rng: random.Random
    network: Network
    servers: dict[str, SimServer]

    def view(self) -> dict[str, Placed]:
        """The servers' records the DHT holds now."""
        ...

    def at(self, when: float, action: Callable[..., None], *args) -> None:
        """Run `action(*args)` at simulated time `when`."""
        ...
