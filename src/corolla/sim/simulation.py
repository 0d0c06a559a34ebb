"""A discrete-event simulation of a swarm's placement, recovery, routing and sessions: no sockets and no real
time, corolla's own decision code under a simulated clock (issue 31).

Servers join and choose their blocks (swarm/policy/placement.py `choose_blocks`) from the records renewed
lately; each announces its record every announce period (a record expires after 2.5 of them and stops counting
for placement after 1.5, as wire/records.py says), and reads the swarm then as server/upkeep/link_monitor.py
does: the rebalancer looks at that read at once when some block has no server, or, while some block has at
most three, at that read less the servers of the weakest blocks that crashed (they would not answer the link
monitor's pings). Every balance period (+-20%) each server checks whether it is a server to move (placement.py
`moves`: the one whose move helps the swarm most, or, while a block has no server, any of the moves planned to
fill the holes, as `Rebalancer` does), moving if so. A crash ends servers at once: their records stay until
they expire. Sessions (sim/sessions.py) are clients of their own. Every sample period the simulation measures
the blocks' coverage by live servers, and routes from random points of the plane: a client's chain
(swarm/policy/routing.py `choose_chain` over the servers that answer its pings, with
client/routing/estimates.py's estimates from announced speeds and its measured round trips) against an
oracle's (the same search over true speeds and every true round trip), both priced at the truth (`chain_cost`,
push on).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from corolla.config import ServerConfig
from corolla.engine.async_engine import PassTiming
from corolla.errors import MissingBlocks
from corolla.server.hosting.pace import Pace
from corolla.server.upkeep.link_monitor import MAX_CHECKED, MAX_LINKS
from corolla.sim.clients import against_oracle, looked_up, noisy
from corolla.sim.compute import cache_tokens, pass_cost
from corolla.sim.network import Network
from corolla.sim.record_book import Record, RecordBook
from corolla.sim.record_tree import RecordTree
from corolla.sim.relays import Relays
from corolla.sim.scenario import Event, Scenario
from corolla.sim.sessions import Sessions
from corolla.sim.state import SimServer, least_held
from corolla.swarm.policy.placement import (
    WATCHED_REPLICAS,
    Placed,
    choose_window,
    coverage,
    moves,
    weakest_holders,
)
from corolla.swarm.policy.routing import choose_chain
from corolla.wire.records import RECORD_LIFETIME, STALE_PERIODS, STALE_SLACK

PASSES_PER_PERIOD = 32


@dataclass
class Coverage:
    time: float
    live_min: int  # servers alive on the least-held block
    view_min: int  # records renewed lately on it (what a joining or moving server counts)
    sessions: int = 0  # sessions open (running, or waiting for blocks)


@dataclass
class Simulation:
    scenario: Scenario
    now: float = 0.0
    servers: dict[str, SimServer] = field(default_factory=dict)
    samples: list[Coverage] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # client's chain / oracle's, per route
    moves: int = 0
    crashes: list[tuple[float, int]] = field(default_factory=list)  # (when, how many)
    leaves: list[tuple[float, int]] = field(default_factory=list)  # graceful: (when, how many)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.scenario.seed)
        scenario = self.scenario
        self.network = Network(scenario.rtt_ms, self.rng, scenario.hidden_bytes, scenario.hole_punch_success)
        self._queue: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._order = itertools.count()
        self._names = itertools.count()
        self.relays = Relays(self.network, self.servers, self.rng)
        self.book = RecordBook(self.scenario.num_blocks)
        self.tree = RecordTree(
            "sim", self.scenario.num_blocks
        )  # where the records are (swarm/records/record_cells.py)
        self._tree_rng = random.Random(self.scenario.seed)
        self._pass_rng = random.Random(f"{self.scenario.seed}-passes")
        self._planned: dict[str, tuple[int, int]] = {}  # placement.moves for the view, once computed
        self._moves_version = -1  # the book's version _planned was computed for
        self.sessions = Sessions(self)

    def run(self) -> Simulation:
        for when, event in self.scenario.timeline():
            self.at(when, self._start_event, event)
        self.at(0.0, self._sample)
        while self._queue and self._queue[0][0] <= self.scenario.duration:
            self.now, _, action, args = heapq.heappop(self._queue)
            action(*args)
        return self

    def at(self, when: float, action: Callable[..., None], *args) -> None:
        heapq.heappush(self._queue, (when, next(self._order), action, args))

    def _start_event(self, event: Event) -> None:
        if event.kind == "crash":
            live = [s for s in self.servers.values() if s.alive]
            self.crash(self.rng.sample(live, round(event.fraction * len(live))), event.silent)
        if event.kind == "leave":
            self._leave(event.fraction)
        if event.kind == "sessions":
            self.sessions.start(event)
        for i in range(event.count if event.kind == "join" else 0):
            self.at(self.now + i * event.every, self._join, event)

    def crash(self, doomed: list[SimServer], silent: bool = True) -> None:
        """Servers end at once, announcing nothing more (their records go stale, then expire). `silent`:
        their machines or networks went (clients notice after their silence limit); else only their
        processes died, and clients see the connections reset at once."""
        for server in doomed:
            server.alive = False
            record = self.book.records.get(server.peer_id)
            if record is None:  # it was leaving: its OFFLINE record already took it out
                continue
            self.at(record.expires, self._expire, server.peer_id, record.expires)
            stale = record.announced_at + STALE_PERIODS * self.scenario.announce_period + STALE_SLACK
            self.at(stale + 1e-6, self.book.went_stale, server.peer_id)
        self.crashes.append((self.now, len(doomed)))
        self.sessions.crashed({server.peer_id for server in doomed}, silent)

    def _leave(self, fraction: float) -> None:
        """Servers stopped gracefully: OFFLINE at once (server.py drain), gone after the drain timeout."""
        live = [s for s in self.servers.values() if s.alive and not s.leaving]
        leaving = self.rng.sample(live, round(fraction * len(live)))
        for server in leaving:
            server.leaving = True
            self.book.withdraw(server.peer_id)
            self.tree.remove(server.peer_id)
        self.leaves.append((self.now, len(leaving)))
        self.at(self.now + ServerConfig.drain_timeout, self._gone, leaving)  # corolla server's default

    def _gone(self, servers: list[SimServer]) -> None:
        for server in servers:
            server.alive = False
        # their clients see the connection closed: they fail over at once
        self.sessions.crashed({server.peer_id for server in servers}, silent=False)

    # a server's life: join, announce, check

    def _join(self, event: Event) -> None:
        classes = self.scenario.classes
        if event.server_class is None:
            kind = self.rng.choices(classes, weights=[c.share for c in classes])[0]
        else:
            kind = next(c for c in classes if c.name == event.server_class)
        noise = 1 + self.rng.uniform(-self.scenario.announce_noise, self.scenario.announce_noise)
        fixed = event.blocks
        blocks = self.rng.randint(kind.min_blocks, kind.max_blocks) if fixed is None else fixed[1] - fixed[0]
        cost = pass_cost(kind)
        server = SimServer(
            f"server{next(self._names)}",
            kind,
            blocks,
            noise * kind.inflate / cost.seconds(1),
            cost,
            Pace(batch_growth=cost.per_token / cost.seconds(1)),  # as hosting/startup_speed.py measures it
            cache_tokens(kind, blocks, self.scenario.kv_bytes_per_token),
        )
        behind_nat = self.rng.random() < kind.behind_nat
        self.network.place(server.peer_id, upload_mbps=kind.upload_mbps, behind_nat=behind_nat)
        if not behind_nat:
            self.relays.public.append(server.peer_id)
        # placement.choose_blocks over the records placement counts, whose coverage the book keeps
        server.start, server.end = fixed or choose_window(
            self.book.cover, self.book.held, server.blocks, self.scenario.num_blocks, server.throughput
        )
        server.fixed = fixed is not None
        self.servers[server.peer_id] = server
        self._announce(server)
        self.at(self.now + self._balance_delay(), self._check, server)

    def _announce(self, server: SimServer) -> None:
        if not server.alive or server.leaving:
            return
        self.relays.reserve(server)
        self._run_passes(server)
        expires = self.now + RECORD_LIFETIME * self.scenario.announce_period
        placed = (server.start, server.end, server.throughput)
        self.book.store(server.peer_id, Record(placed, self.now, expires))
        blocks = range(server.start, server.end)
        self.tree.announce(server.peer_id, blocks, self._tree_rng, server.speed, server.device)
        # it pings up to MAX_LINKS servers whose spans start where its own ends
        # (server/upkeep/link_monitor.py), from a read of the swarm that the rebalancer looks at too: a block
        # without a server is checked at once
        after = sorted(p for p in self.book.starting.get(server.end, ()) if self.servers[p].alive)
        chosen = self.rng.sample(after, min(len(after), MAX_LINKS))
        server.links = {
            peer_id: self.network.rtt(server.peer_id, peer_id) * noisy(self, self.rng) for peer_id in chosen
        }
        if self.book.has_hole():
            self._decide(server)
        elif min(self.book.held) <= WATCHED_REPLICAS:  # it pings the weakest blocks' servers (link_monitor)
            self._decide_on_answers(server)
        self.at(self.now + self.scenario.announce_period, self._announce, server)

    def _run_passes(self, server: SimServer) -> None:
        """Its decode passes since its last announcement feed its pace (server/hosting/pace.py), which clients
        route by: PASSES_PER_PERIOD passes of its batch now, each its true time with the scenario's
        pass_noise (a real server runs thousands a period; the pace keeps the latest WINDOW)."""
        rows = server.sessions
        if not rows:
            return
        blocks = server.end - server.start
        true = blocks * server.step_seconds(rows - 1)
        for _ in range(PASSES_PER_PERIOD):
            seconds = true * self._pass_rng.lognormvariate(0, self.scenario.pass_noise)
            server.pace.observe(PassTiming(rows, rows, blocks, seconds))

    def _check(self, server: SimServer) -> None:
        if server.alive and not server.leaving:
            self._decide(server)
            self.at(self.now + self._balance_delay(), self._check, server)

    def _decide(self, server: SimServer, planned: dict[str, tuple[int, int]] | None = None) -> None:
        """Rebalancer.check: move if this server is one to move now (placement.my_move) in `planned` (the
        moves its own view gives), else in the moves of the records placement counts."""
        target = None if server.fixed else (self._moves() if planned is None else planned).get(server.peer_id)
        if target is not None:
            server.start, server.end = target
            self.moves += 1
            record = self.book.records[server.peer_id]
            self.book.store(
                server.peer_id, Record((*target, server.throughput), record.announced_at, record.expires)
            )
            self.tree.announce(server.peer_id, range(*target), self._tree_rng, server.speed, server.device)

    def _decide_on_answers(self, server: SimServer) -> None:
        """Rebalancer.look after the link monitor's pings: the records placement counts, less the weakest
        blocks' servers that did not answer (crashed, their records not stale yet): holes are filled now."""
        total = self.scenario.num_blocks
        pinged = [p for p in weakest_holders(self.book.placed, total, MAX_CHECKED + 1) if p != server.peer_id]
        silent = [peer for peer in pinged[:MAX_CHECKED] if not self.servers[peer].alive]  # as its own read
        if not silent or server.fixed:
            return
        view = {peer: placed for peer, placed in self.book.placed.items() if peer not in silent}
        if min(coverage(view.values(), total)) <= 0:
            self._decide(server, moves(view, total))

    def _expire(self, peer_id: str, when: float) -> None:
        self.book.expire(peer_id, when)
        if peer_id not in self.book.records:
            self.tree.remove(peer_id)

    def _balance_delay(self) -> float:
        return self.scenario.balance_period * self.rng.uniform(0.8, 1.2)

    def view(self) -> dict[str, Placed]:
        """The servers' records the DHT holds now: what clients read (not to be changed by the caller)."""
        return self.book.view

    def placed(self) -> dict[str, Placed]:
        """Of those, the records renewed lately: what placement and rebalancing count (swarm/dht.py
        placed_servers)."""
        return self.book.placed

    def _moves(self) -> dict[str, tuple[int, int]]:
        """placement.moves, once per view: every server checking the same view gets the same answer."""
        if self._moves_version != self.book.version:
            self._planned = moves(self.book.placed, self.scenario.num_blocks)
            self._moves_version = self.book.version
        return self._planned

    # measuring

    def _sample(self) -> None:
        view = [(placed[0], placed[1], 1.0) for placed in self.placed().values()]
        total = self.scenario.num_blocks
        live = least_held(self.servers.values(), total)
        self.samples.append(Coverage(self.now, live, int(min(coverage(view, total))), self.sessions.open))
        for _ in range(self.scenario.routes_per_sample):
            self._route()
        self.at(self.now + self.scenario.sample_every, self._sample)

    def _route(self) -> None:
        """One client's chain against the oracle's, from a random point of the plane (no session)."""
        client = f"client{next(self._names)}"
        self.network.place(client, upload_mbps=self.scenario.client_upload_mbps)
        spans, measured = looked_up(self, client, self.rng)
        announced = {span.peer_id: dict(span.info.next_pings) for span in spans}
        total = self.scenario.num_blocks
        try:
            estimates = measured.estimates(spans)
            chosen = choose_chain(
                spans, 0, total, estimates=estimates, links=announced, push=True, rng=self.rng
            )
            self.ratios.append(against_oracle(self, client, chosen, 0, total, self.rng))
        except MissingBlocks:
            return
        finally:
            self.network.forget(client)
