"""Inference sessions in a simulated swarm, each from a client (one of its own, or one of the scenario's
long-lived `clients`) deciding with corolla's client code under the simulation's clock:
client/routing/router.py `Router.choose` (the routable filter and the cheapest chain over what the client
knows: client/routing/estimates.py from its pings, the records it read), client/routing/bans.py `Bans` and
client/chain/retries.py `RetryBudget` for failover, and client/routing/estimates.py's silence rule for how
long a crashed server's silence takes to notice.

Opening a chain is client/chain/opening.py `open_links`: a server whose cache cannot take the session's tokens
(its prompt's and its steps': the engine allocates cache as positions are written, so a session takes what it
uses, not its max_length) refuses it (the engine's admission, with the client's default alloc_timeout of 0),
and the client passes that server over for a while (client/chain/opening.py `pass_over`, the client's own) and
routes again, up to `opening_tries` times. A session holds its servers (and that much of their caches) for its
decode steps at its chain's true per-token latency (swarm/policy/routing.py `chain_cost` at true speeds, round
trips, uploads and batch loads, push on); the latency is fixed when the chain is chosen (loads that change
later do not change it). When a server of its chain crashes, the client notices after the silence limit (at
once when a leaving server ends its drain), bans the server and routes the failed hop's blocks again
(`_fail_over`), as client/chain/chain.py `_recover` does; with a block uncovered it waits up to
`routing_timeout` (looking every LONGEST_WAIT seconds, as the router does), then the session is lost. When a
session ends its client has timed its first hop's steps (the only ones push lets it time): its estimates get
that server's last TIMED_STEPS steps, each its true time with the scenario's `step_noise`. Lost sessions are
counted apart when every block still had a live server (a routing failure, which must never happen).
Simplifications: a client pings every server at each decision (the real one re-pings every `refresh_period`),
and a replacement's replay costs no time.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict

from corolla.client.chain.opening import opening_tries, out_of_tries, pass_over
from corolla.client.chain.retries import RetryBudget
from corolla.client.routing.bans import Bans
from corolla.client.routing.estimates import PROBE_FLOOR, ServerEstimates, silence_after
from corolla.client.routing.router import LONGEST_WAIT, Router
from corolla.client.rpc.stall_probe import STUCK_FLOOR, STUCK_LIMITS
from corolla.config import ClientConfig
from corolla.errors import CacheExhausted, MissingBlocks, ServerUnavailable
from corolla.sim.clients import against_oracle, looked_up, starved_for_cache, truth
from corolla.sim.scenario import Event
from corolla.sim.session import ChainView, SimClient, SimSession
from corolla.sim.state import SimSwarm, least_held
from corolla.swarm.policy.routing import Hop, chain_cost

TIMED_STEPS = 8  # a session's last decode steps a client's moving average of step times mostly holds


class Sessions:
    def __init__(self, sim: SimSwarm):
        self.sim = sim
        self.config = ClientConfig()
        self.on: dict[str, set[SimSession]] = defaultdict(set)  # peer id -> sessions with a hop there
        self.started = self.finished = self.lost = self.lost_while_covered = self.misrouted = 0
        self.turned_away = 0  # sessions no server had cache for, at their first opening
        self.lost_for_cache = 0  # sessions lost failing over because no server had cache for them
        self.refusals = 0  # servers that refused to open a session (no cache), all sessions
        self.failovers: list[int] = []  # per finished session
        self.replaced = 0  # servers replaced in sessions' chains, all sessions
        self.waited = 0  # sessions that waited for a block without a server
        self.stalls = 0  # chains through silent acceptors, each stalled until found stuck
        self.stalled_seconds = 0.0
        self.latencies: list[float] = []  # per chain chosen: true seconds per token
        self.ratios: list[float] = []  # a sample of sessions' first chains: true latency / the oracle's
        self.clients: list[SimClient] = []  # the long-lived ones (scenario.clients)
        self._names = itertools.count()
        # sessions draw from their own generator: a scenario's swarm goes the same way with or without them
        self.rng = random.Random(f"{sim.scenario.seed}-sessions")

    @property
    def open(self) -> int:
        return self.started - self.finished - self.lost - self.turned_away

    def start(self, event: Event) -> None:
        for _ in range(event.count):
            self.sim.at(self.sim.now + self.rng.uniform(0, event.over), self._arrive)

    def crashed(self, peer_ids: set[str], silent: bool = True) -> None:
        """Servers crashed: each session on them notices after its silence limit (`silent`; else at once:
        a server that ends its drain closes its connections) and fails over."""
        stranded = set().union(*(self.on.pop(peer_id, set()) for peer_id in peer_ids))
        for session in sorted(stranded, key=lambda session: session.serial):
            silence = silence_after(session.latency) + PROBE_FLOOR if silent else 0.0  # the missed ping
            session.advance(self.sim.now)
            session.latency = 0.0  # paused: its next step waits on a dead server
            session.version += 1  # and it does not end as planned
            self.sim.at(self.sim.now + silence, self._fail_over, session, peer_ids)

    def _client(self) -> SimClient:
        """One of the long-lived clients, or (without them, or while they are still too few) a new one."""
        sim = self.sim
        pool = sim.scenario.clients
        if pool and len(self.clients) >= pool:
            return self.rng.choice(self.clients)
        bans = Bans(self.config, clock=lambda: sim.now)
        client = SimClient(f"user{next(self._names)}", bans, ServerEstimates(), pooled=pool > 0)
        scenario = sim.scenario
        behind_nat = self.rng.random() < scenario.clients_behind_nat
        sim.network.place(client.name, self.rng, scenario.client_upload_mbps, behind_nat)
        if client.pooled:
            self.clients.append(client)
        return client

    def _arrive(self) -> None:
        sim = self.sim
        steps = self.rng.randint(*sim.scenario.session_steps)
        self.started += 1
        session = SimSession(self._client(), steps, sim.scenario.prompt_tokens + steps, serial=self.started)
        session.gaps.append((0, sim.scenario.num_blocks))
        self._repair(session, session.version, first=self.started % sim.scenario.oracle_every == 0)

    def _fail_over(self, session: SimSession, peer_ids: set[str]) -> None:
        if session.version < 0:  # over already
            return
        budget = RetryBudget(self.config, clock=lambda: self.sim.now)
        for index in reversed(range(len(session.hops))):
            hop = session.hops[index]
            if hop.peer_id in peer_ids:
                session.client.bans.ban(hop.peer_id)
                try:
                    budget.spend(ServerUnavailable(f"server {hop.peer_id} crashed"))
                except ServerUnavailable:
                    return self._lose(session)
                self._release([hop], session)
                del session.hops[index]
                session.gaps.append((hop.start, hop.end))
                session.failovers += 1
                self.replaced += 1
        self._repair(session, session.version)

    def _repair(self, session: SimSession, version: int, first: bool = False) -> None:
        """Route every gap of the session's chain; wait (or lose it) while some block has no server."""
        sim = self.sim
        if version != session.version:
            return
        session.advance(sim.now)
        while session.gaps:
            start, end = session.gaps[-1]
            try:
                hops = self._open(session, start, end, first)
            except ServerUnavailable:
                return self._lose(session)
            except MissingBlocks:
                session.latency = 0.0  # paused
                if session.waiting_since is None:
                    session.waiting_since = sim.now
                    self.waited += 1
                if sim.now - session.waiting_since >= self.config.routing_timeout:
                    return self._lose(session)
                session.version += 1
                sim.at(sim.now + LONGEST_WAIT, self._repair, session, session.version)
                return
            session.gaps.pop()
            session.hops = sorted([*session.hops, *hops], key=lambda hop: hop.start)
            session.client.estimates.acquire(hops)
            for hop in hops:
                server = sim.servers[hop.peer_id]
                server.sessions += 1
                server.reserved += session.tokens
                self.on[hop.peer_id].add(session)
        session.waiting_since = None
        session.refused = False
        self._resume(session)

    def _resume(self, session: SimSession) -> None:
        """A whole chain again: its true latency from now on, and when it will have run its steps."""
        sim = self.sim
        session.opened = True
        true = truth(sim, session.client.name, {hop.peer_id for hop in session.hops}, joining=False)
        session.latency = chain_cost(session.hops, true, sim.network.links(), push=True)
        session.version += 1
        acceptors = {hop.peer_id for hop in session.hops if sim.servers[hop.peer_id].kind.silent_acceptor}
        if acceptors:  # its next step waits on servers that answer pings and never compute
            stuck = max(STUCK_FLOOR, STUCK_LIMITS * silence_after(session.latency))  # stall_probe.py's rule
            self.stalls += 1
            self.stalled_seconds += stuck
            session.latency = 0.0  # paused
            sim.at(sim.now + stuck, self._fail_over, session, acceptors)
            return
        self.latencies.append(session.latency)
        left = (session.steps - session.done) * session.latency
        sim.at(sim.now + left, self._end, session, session.version)

    def _open(self, session: SimSession, start: int, end: int, oracle: bool) -> list[Hop]:
        """client/chain/opening.py `open_links`: a chain whose servers all take the session, passing over
        those that refuse it (no cache for it: `pass_over` with CacheExhausted) and routing again, up to
        `opening_tries`; then its ServerUnavailable."""
        for _ in range(opening_tries(self.config)):
            hops = self._choose(session, start, end, oracle)
            refused = [hop for hop in hops if not self.sim.servers[hop.peer_id].admits(session.tokens)]
            if not refused:
                return hops
            self.refusals += len(refused)
            session.refused = True
            pass_over(
                session.client.bans, [(hop, CacheExhausted("no cache for the session")) for hop in refused]
            )
            oracle = False  # compared once per session
        raise out_of_tries(self.config, start, end)

    def _choose(self, session: SimSession, start: int, end: int, oracle: bool) -> list[Hop]:
        """The client's chain over [start, end) (client/routing/router.py; a gap's neighbours in the chain
        shunned, as Chain's replacements do); with `oracle`, also the oracle's."""
        sim = self.sim
        client = session.client
        spans, estimates = looked_up(sim, client.name, self.rng, client.estimates)
        view = ChainView(spans, {s.peer_id for s in spans})
        router = Router(self.config, sim.scenario.num_blocks, view, client.bans, estimates, rng=self.rng)
        tokens = sim.scenario.session_tokens
        shun = {hop.peer_id for hop in session.hops if hop.end == start or hop.start == end}  # neighbours
        hops = router.choose(start, end, needed_cache=tokens, max_length=tokens, shun=shun)
        self.misrouted += any(
            not sim.servers[hop.peer_id].alive or hop.peer_id in client.bans.banned() for hop in hops
        )
        if oracle:
            self.ratios.append(against_oracle(sim, client.name, hops, start, end, self.rng))
        return hops

    def _end(self, session: SimSession, version: int) -> None:
        if version != session.version:
            return
        # with push the client times only its first hop (client/chain/chain.py: pushed-to servers' replies
        # may come before its own copy left): what it learns of that server's true speed
        first = session.hops[0]
        true = truth(self.sim, session.client.name, [first.peer_id], joining=False)[first.peer_id]
        blocks = first.end - first.start
        noise = self.sim.scenario.step_noise
        for _ in range(min(session.steps, TIMED_STEPS)):  # its last steps: what the moving average holds
            seconds = (true.rtt + blocks * true.seconds_per_block) * self.rng.lognormvariate(0, noise)
            session.client.estimates.observe_step(first.peer_id, seconds, blocks)
        self._release(session.hops, session)
        self.finished += 1
        self.failovers.append(session.failovers)
        self._forget(session)

    def _lose(self, session: SimSession) -> None:
        """The session failed: it waited routing_timeout for blocks, its failover budget ran out, or (with
        `refused` set) servers had no cache for it."""
        sim = self.sim
        # it waited for blocks whose only servers its client passes over for cache: lost for cache too
        refused = session.refused or starved_for_cache(sim, session.client.bans)
        if refused and not session.opened:
            self.turned_away += 1  # refused at its first opening: the user's request fails at once
            return self._forget(session)
        self._release(session.hops, session)
        self.lost += 1
        if refused:  # failing over, no server had cache for it
            self.lost_for_cache += 1
        else:
            self.lost_while_covered += least_held(sim.servers.values(), sim.scenario.num_blocks) > 0
        self._forget(session)

    def _release(self, hops: list[Hop], session: SimSession) -> None:
        session.client.estimates.release(hops)
        for hop in hops:
            server = self.sim.servers[hop.peer_id]
            server.sessions -= 1
            server.reserved -= session.tokens
            self.on.get(hop.peer_id, set()).discard(session)

    def _forget(self, session: SimSession) -> None:
        session.version = -1
        if not session.client.pooled:
            self.sim.network.forget(session.client.name)
