"""What a simulated client knows of the swarm when it routes, and what is true.

A client reads the servers' records (those the DHT still holds, in the records' tree as far as
CLIENT_CELLS cells allow: swarm/records/record_cells.py) and pings every server of them: a
crashed server does not answer, a live one answers with its live load and its announced links (what
client/routing/swarm_view.py and client/routing/estimates.py get from `rpc_info`, its free cache included).
Its round trips come out up to 20% above the true ones (a ping's own overhead; a ping carries no hidden
states, so it says nothing of uploads). The oracle knows every server's true speed and load and every true
round trip and upload.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from corolla.client.routing.bans import Bans
from corolla.client.routing.estimates import ServerEstimates
from corolla.sim.record_tree import seen
from corolla.sim.state import SimServer, SimSwarm, least_held
from corolla.swarm.dht import RemoteSpan
from corolla.swarm.policy.placement import Placed
from corolla.swarm.policy.routing import Estimate, Hop, chain_cost, choose_chain
from corolla.swarm.records.record_cells import CLIENT_CELLS
from corolla.wire.records import ServerStatus


def span(server: SimServer, placed: Placed) -> RemoteSpan:
    """A server as its record (`placed`) and its ping's reply describe it."""
    start, end, throughput = placed
    info = ServerStatus(
        start,
        end,
        "sim",
        "float16",
        8192,
        server.free_cache(),
        throughput=throughput,
        pace=server.announced_pace(),  # as its ping says now
        # what server/hosting/startup_speed.py measures: (a step of 8 sequences / one's - 1) / 7
        batch_growth=server.cost.per_token / server.cost.seconds(1),
        num_sessions=server.sessions,
        next_pings=tuple(server.links.items()),
        device_name=server.device,
    )
    return RemoteSpan(server.peer_id, start, end, info)


def looked_up(
    sim: SimSwarm, client: str, rng: random.Random, estimates: ServerEstimates | None = None
) -> tuple[list[RemoteSpan], ServerEstimates]:
    """The spans of the servers that answer `client`'s pings, and its estimates of them (`estimates`: a
    long-lived client's, which its pings update)."""
    view = sim.view()
    found = seen(sim.tree.walk(None, CLIENT_CELLS, rng))  # as client/client.py reads
    answering = [s for s in sim.servers.values() if s.alive and s.peer_id in view and s.peer_id in found]
    spans = [span(s, view[s.peer_id]) for s in answering]
    estimates = ServerEstimates() if estimates is None else estimates
    for server, found in zip(answering, spans, strict=True):
        rtt = sim.network.rtt(client, server.peer_id)
        estimates.ping(server.peer_id, rtt * rng.uniform(1.0, 1.2) * noisy(sim, rng), found.info)
    return spans, estimates


def starved_for_cache(sim: SimSwarm, bans: Bans) -> bool:
    """Whether every block has a live server but some only has servers `bans` passes over for want of
    cache (refused by them lately, maybe in another session of the same client): a session that waits
    then waits for cache, not for servers."""
    servers = sim.servers.values()
    total = sim.scenario.num_blocks
    return least_held(servers, total) > 0 and least_held(servers, total, bans.out_of_cache()) == 0


def noisy(sim: SimSwarm, rng: random.Random) -> float:
    """A measured round trip's factor over the true one (the scenario's `ping_noise`; no draw without)."""
    noise = sim.scenario.ping_noise
    return rng.lognormvariate(0, noise) if noise else 1.0


def truth(sim: SimSwarm, client: str, peer_ids: Iterable[str], joining: bool) -> dict[str, Estimate]:
    """Each server's true round trip from `client` (its data both ways included) and true time per block
    of a step, with the other sessions in its batch (`joining`: the client's session is about to be one
    more)."""
    true = {}
    for peer_id in peer_ids:
        server = sim.servers[peer_id]
        others = server.sessions if joining else max(server.sessions - 1, 0)
        true[peer_id] = Estimate(sim.network.step_round_trip(client, peer_id), server.step_seconds(others))
    return true


def against_oracle(
    sim: SimSwarm, client: str, hops: list[Hop], start: int, end: int, rng: random.Random
) -> float:
    """`hops`' true step time over the oracle's chain's: the oracle routes over every live server with a
    record (not only those the client's walk found), knowing every server's true speed and load (the
    client's session about to be one more there) and every true round trip; both chains are priced at
    that truth (push on)."""
    view = sim.view()
    live = [server for server in sim.servers.values() if server.alive and server.peer_id in view]
    spans = [span(server, view[server.peer_id]) for server in live]
    true = truth(sim, client, [server.peer_id for server in live], joining=True)
    links = sim.network.links()
    best = choose_chain(spans, start, end, estimates=true, links=links, push=True, rng=rng)
    return chain_cost(hops, true, links, True) / chain_cost(best, true, links, True)
