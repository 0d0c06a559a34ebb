"""One simulated session and the client it belongs to (sim/sessions.py runs them): what it holds, where it
stands, and what the router reads of the swarm for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from corolla.client.routing.bans import Bans
from corolla.client.routing.estimates import ServerEstimates
from corolla.swarm.dht import RemoteSpan
from corolla.swarm.policy.routing import Hop


@dataclass(eq=False)
class SimClient:
    """A client process: its place on the plane, its bans and its estimates, kept across its sessions."""

    name: str
    bans: Bans
    estimates: ServerEstimates
    pooled: bool  # one of the scenario's long-lived clients (else made for one session)


@dataclass(eq=False)
class SimSession:
    client: SimClient
    steps: int  # decode steps it runs
    tokens: int  # of cache it takes on each server of its chain: its prompt's and its steps'
    hops: list[Hop] = field(default_factory=list)
    gaps: list[tuple[int, int]] = field(default_factory=list)  # blocks it has no server for yet
    latency: float = 0.0  # true seconds per token of its chain (0: paused, some blocks have no server)
    done: float = 0.0  # steps run so far
    since: float = 0.0  # when `latency` began to apply
    failovers: int = 0
    version: int = 0  # its end is the one scheduled for this version
    waiting_since: float | None = None  # since when some block has had no server for it
    opened: bool = False  # it has had a whole chain
    refused: bool = False  # a server had no cache for it (since it last had a whole chain)
    serial: int = 0  # the order it arrived in: sessions are handled in it, never in memory's order

    def advance(self, now: float) -> None:
        if self.latency > 0:
            self.done += (now - self.since) / self.latency
        self.since = now


@dataclass
class ChainView:
    """What client/routing/router.py reads of client/routing/swarm_view.py's SwarmView: the spans read and who
    answered."""

    spans: list[RemoteSpan]
    answered: set[str]
    refusals: dict[str, str] = field(default_factory=dict)
    stale: bool = False
