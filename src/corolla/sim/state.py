"""What the simulated swarm's parts share: a server as the simulation tracks it, and the swarm as
clients and sessions see it (sim/simulation.py's Simulation is one)."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from corolla.server.hosting.pace import Pace
from corolla.sim.compute import PassCost
from corolla.sim.network import Network
from corolla.sim.record_tree import RecordTree
from corolla.sim.scenario import Scenario, ServerClass
from corolla.swarm.policy.placement import Placed, coverage
from corolla.wire.records import routing_speed


@dataclass(eq=False)
class SimServer:
    peer_id: str
    kind: ServerClass
    blocks: int  # how many it holds
    throughput: float  # announced start-up figure: true speed off by up to announce_noise (or a lie)
    cost: PassCost  # its true speed: a pass over one of its blocks
    pace: Pace = field(default_factory=Pace)  # its passes' (server/hosting/pace.py), announced beside it
    cache: int | None = None  # tokens of attention cache it holds (None: no limit)
    start: int = 0
    end: int = 0
    fixed: bool = False  # its blocks were given (`corolla server --blocks`): it never moves
    alive: bool = True
    leaving: bool = False  # announced OFFLINE, serving its open sessions until the drain timeout
    links: dict[str, float] = field(default_factory=dict)  # round trips to servers after it, announced
    sessions: int = 0  # open sessions with a hop here
    reserved: int = 0  # tokens of cache those sessions reserved

    def admits(self, tokens: int) -> bool:
        """Whether a session reserving `tokens` of cache gets them now (the engine would make it wait
        for pages up to its alloc_timeout, then refuse it: here it is refused at once)."""
        return self.cache is None or self.reserved + tokens <= self.cache

    def free_cache(self) -> int:
        return (1 << 40) if self.cache is None else max(self.cache - self.reserved, 0)

    @property
    def speed(self) -> float:
        """What clients route by and the blocks' keys rank by (ServerStatus.speed)."""
        return routing_speed(self.announced_pace(), self.throughput)

    @property
    def device(self) -> str:
        """The device its record and pings name."""
        device = self.kind.device or self.kind.name
        return f"{device} {self.peer_id}" if self.kind.unique_device else device

    def announced_pace(self) -> float | None:
        """The pace its record and pings carry: its passes' (a liar's, inflated)."""
        pace = self.pace.blocks_per_s()
        return None if pace is None else pace * self.kind.inflate

    def step_seconds(self, others: int) -> float:
        """True seconds per block of a decode step with `others` sessions in the same batch."""
        return self.cost.seconds(others + 1)


def least_held(servers: Iterable[SimServer], total: int, passed_over: Collection[str] = ()) -> int:
    """Live servers on the block that has fewest (those in `passed_over` left out)."""
    spans = [(s.start, s.end, 1.0) for s in servers if s.alive and s.peer_id not in passed_over]
    return int(min(coverage(spans, total)))


class SimSwarm(Protocol):
    scenario: Scenario
    now: float
    rng: random.Random
    network: Network
    servers: dict[str, SimServer]
    tree: RecordTree  # where the records are: what a client's walk finds

    def view(self) -> dict[str, Placed]:
        """The servers' records the DHT holds now."""
        ...

    def at(self, when: float, action: Callable[..., None], *args) -> None:
        """Run `action(*args)` at simulated time `when`."""
        ...
