"""Routing without sockets: the one routability filter, waiting for servers, re-pinging silent ones once,
and what MissingBlocks says. The servers are records and scripted pings (the view's two inputs)."""

from __future__ import annotations

import asyncio

import pytest

from corolla.client.routing.bans import Bans
from corolla.client.routing.estimates import ServerEstimates
from corolla.client.routing.router import Router
from corolla.client.routing.swarm_view import SwarmView
from corolla.config import ClientConfig
from corolla.errors import InvalidRequest, MissingBlocks
from corolla.swarm.dht import RemoteSpan
from corolla.swarm.p2p.ping import Ping
from corolla.swarm.policy.routing import LOAD_WEIGHT, Hop
from corolla.wire.records import ServerStatus


def span(peer: str, start: int, end: int, **status) -> RemoteSpan:
    fields = {"inference_max_length": 1024, "cache_tokens_available": 512, **status}
    return RemoteSpan(peer, start, end, ServerStatus(start, end, "0.1.0", "float32", **fields))


class Pings:
    """Answers pings as scripted: a server answers from its `silent`-th ping on, or refuses this peer."""

    def __init__(
        self,
        silent: dict[str, int] | None = None,
        refusing: dict[str, str] | None = None,
        speeds: dict[str, float] | None = None,
        devices: dict[str, str] | None = None,
    ):
        self.silent, self.refusing, self.count = silent or {}, refusing or {}, {}
        self.speeds = speeds or {}  # blocks per second its reply says (else none)
        self.devices = devices or {}  # the device its reply names (else none)
        self.reads = 0  # DHT reads (the router's view refreshes)

    async def ping(self, peer_id: str) -> Ping:
        self.count[peer_id] = self.count.get(peer_id, 0) + 1
        if peer_id in self.refusing:
            return Ping(refusal=self.refusing[peer_id])
        if self.count[peer_id] <= self.silent.get(peer_id, 0):
            return Ping()
        speed, device = self.speeds.get(peer_id), self.devices.get(peer_id, "")
        return Ping(
            0.01, ServerStatus(0, 6, "0.1.0", "float32", 1024, 512, throughput=speed, device_name=device)
        )


def router(spans, pings=None, **config) -> tuple[Router, Bans, Pings]:
    """A router over `spans` (a list, or a callable giving the list at each DHT read)."""
    config = ClientConfig(**{"routing_timeout": 1.0, **config})
    pings = pings or Pings()

    async def read(tally):
        pings.reads += 1
        return list(spans() if callable(spans) else spans)

    bans, estimates = Bans(config), ServerEstimates()
    view = SwarmView(config, "", read, pings, estimates, bans)
    return Router(config, 6, view, bans, estimates), bans, pings


async def test_the_one_filter_leaves_out_banned_avoided_disallowed_unanswered_and_unfit_servers():
    servers = [
        span("plain", 0, 6),
        span("lora", 0, 6, adapters=("mine",)),
        span("int8", 0, 6, precision="int8"),
        span("short", 0, 6, inference_max_length=64),
        span("mute", 0, 6),
    ]
    route, bans, _ = router(servers, Pings(silent={"mute": 99}))
    await route._view.refresh()
    usable = {s.peer_id for s in route.routable(0, 6, max_length=128)}
    assert usable == {"plain", "lora", "int8"}  # "short" takes 64 tokens, "mute" never answered
    bans.ban("plain")
    assert {s.peer_id for s in route.routable(0, 6, 128, avoid={"lora"})} == {"int8"}
    assert {s.peer_id for s in route.routable(0, 6, 128, allowed={"lora", "short"})} == {"lora"}
    exact, _, _ = router(servers, exact=True, active_adapter="mine")
    await exact._view.refresh()
    assert [s.peer_id for s in exact.routable(0, 6)] == ["lora"]  # the adapter, full precision
    limited, _, _ = router([span("short", 0, 6, inference_max_length=64)])
    await limited._view.refresh()
    with pytest.raises(
        InvalidRequest, match="max_length=128 exceeds the inference_max_length of every server"
    ):
        limited.routable(0, 6, max_length=128)  # refused before anything is sent


async def test_a_client_restricted_to_some_servers_routes_through_parts_of_their_spans():
    servers = [span("a", 0, 6), span("b", 0, 3), span("c", 3, 6), span("d", 0, 2), span("e", 2, 4)]
    route, _, _ = router(servers, allowed_servers=("d", "e", "c"))
    chain = await route.route()
    assert [hop.peer_id for hop in chain] == ["d", "e", "c"]
    assert chain[0] == Hop("d", 0, 2) and chain[1].start == 2 and chain[-1].end == 6
    assert await route.route(3, 5) == [Hop("c", 3, 5)]


async def test_a_replacement_goes_around_its_neighbours_where_others_serve_and_through_them_otherwise():
    """Hop 2:4 of a chain "a" 0:2, ?, "a2" 4:6 failed: "a" and "a2" also hold 2:4 and are the fastest, but a
    chain through them would visit a server twice in a row (a round trip and a pass for nothing)."""
    speeds = {"a": 100.0, "a2": 100.0, "slow": 1.0, "b": 1.0}
    servers = [span("a", 0, 4), span("a2", 3, 6), span("slow", 2, 4)]
    route, _, _ = router(servers, Pings(speeds=speeds))
    assert {hop.peer_id for hop in await route.route(2, 4)} & {"a", "a2"}  # unshunned: the fast ones
    assert await route.route(2, 4, shun={"a", "a2"}) == [Hop("slow", 2, 4)]
    # only a neighbour serves block 1: through it after all, and the rest around it
    route, _, _ = router([span("a", 0, 4), span("b", 1, 2)], Pings(speeds=speeds))
    assert await route.route(1, 2, shun={"a"}) == [Hop("b", 1, 2)]
    assert await route.route(0, 2, shun={"a"}) == [Hop("a", 0, 2)]


async def test_a_speed_far_above_its_devices_is_not_believed():
    """A home GPU announcing 100x its speed would draw the route from a real H100; bounded by the median of
    what the servers of its device announce (swarm/policy/plausible.py), it does not."""
    speeds = {"h100": 100.0, "liar": 1000.0, "g1": 10.0, "g2": 10.0, "g3": 10.0}
    devices = {"h100": "H100", **{peer: "RTX 3060" for peer in ("liar", "g1", "g2", "g3")}}
    servers = [span("h100", 0, 6), span("liar", 0, 6), *(span(f"g{i}", 0, 1) for i in (1, 2, 3))]
    route, _, _ = router(servers, Pings(speeds=speeds, devices=devices))
    assert await route.route() == [Hop("h100", 0, 6)]
    route, _, _ = router(servers[:2], Pings(speeds=speeds, devices=devices))  # nobody to compare it with
    assert await route.route() == [Hop("liar", 0, 6)]


async def test_a_server_that_missed_its_ping_is_pinged_again_once_before_waiting():
    route, _, pings = router([span("late", 0, 6)], Pings(silent={"late": 1}))  # misses the first ping
    assert await route.route() == [Hop("late", 0, 6)]
    await asyncio.sleep(0.01)
    # pinged again at once (answering: 3 pings, one round trip alone is noise), not after a wait and a
    # second read of the DHT
    assert pings.count["late"] == 4 and pings.reads == 1


async def test_a_first_route_waits_for_one_answer_from_a_new_server_not_three():
    class HeldPings(Pings):
        """Every ping after a server's first waits until `go` is set."""

        def __init__(self):
            super().__init__()
            self.go = asyncio.Event()

        async def ping(self, peer_id: str) -> Ping:
            if self.count.get(peer_id, 0) >= 1:
                await self.go.wait()
            return await super().ping(peer_id)

    pings = HeldPings()
    route, _, _ = router([span("a", 0, 3), span("b", 3, 6)], pings)
    assert await route.route() == [Hop("a", 0, 3), Hop("b", 3, 6)]
    assert pings.count == {"a": 1, "b": 1}  # the further pings still held
    pings.go.set()
    await asyncio.sleep(0.01)
    assert pings.count == {"a": 3, "b": 3}


async def test_the_router_waits_for_a_server_to_join_then_routes_through_it():
    joined = []
    route, _, _ = router(lambda: [span("a", 0, 3), *joined], routing_timeout=30.0)
    waiting = asyncio.ensure_future(route.route())
    await asyncio.sleep(0.3)
    assert not waiting.done()  # blocks 3-5 uncovered: it waits
    joined.append(span("b", 3, 6))
    assert await asyncio.wait_for(waiting, 10) == [Hop("a", 0, 3), Hop("b", 3, 6)]


async def test_missing_blocks_name_the_blocks_and_why_servers_refused_this_peer():
    pings = Pings(refusing={"private": "peer Qm... is not allowed in this private swarm"})
    route, _, _ = router([span("a", 0, 3), span("private", 3, 6)], pings, routing_timeout=0.3)
    with pytest.raises(MissingBlocks) as info:
        await route.route()
    message = str(info.value)
    assert info.value.blocks == (3, 4, 5) and "no server available for blocks 3-5" in message
    assert "waited 0s" in message and "1 server refused this peer: peer Qm... is not allowed" in message
    with pytest.raises(MissingBlocks):  # without waiting, at once
        await route.route(wait=False)


def test_a_pings_load_already_counts_this_clients_sessions_there():
    """Live load from a ping includes the sessions this client had there then: only those opened (or
    closed) since are added; an announcement's load gets all of this client's added."""
    estimates = ServerEstimates()
    busy = span("a", 0, 6, num_sessions=5)  # the DHT record's (older) count
    mine = [Hop("a", 0, 6)] * 2
    estimates.acquire(mine)
    assert estimates.estimate(busy).load == 5 + 2  # not pinged yet: the record's count plus ours
    estimates.ping("a", 0.01, ServerStatus(0, 6, "0.1.0", "float32", 1024, 512, num_sessions=3))
    assert estimates.estimate(busy).load == 3  # our 2 are among the 3 the server counted
    estimates.acquire([Hop("a", 0, 6)])
    assert estimates.estimate(busy).load == 4  # one more since the ping
    estimates.release(mine)
    assert estimates.estimate(busy).load == 2  # two closed since the ping


def test_a_servers_measured_batch_growth_prices_its_load_until_then_the_guess():
    estimates = ServerEstimates()
    old = span("a", 0, 6)  # a record from a server too old to measure it
    assert estimates.estimate(old).load_growth == LOAD_WEIGHT
    said = span("b", 0, 6, batch_growth=0.02)
    assert estimates.estimate(said).load_growth == 0.02
    estimates.ping("b", 0.01, ServerStatus(0, 6, "0.1.0", "float32", 1024, 512, batch_growth=0.05))
    assert estimates.estimate(said).load_growth == 0.05  # the ping's, fresher


async def test_a_session_kept_idle_for_its_prefix_is_no_load_on_the_chain_that_holds_it():
    """client/generation/prefix_cost.py prices forking the chain that holds a prefix: the holder's own
    session there runs in no pass. Counted as load, it priced that chain up by the servers' batch growth
    (SmolLM2's measured 20-28%, past prefix_cost.ALIKE), and a follow-up turn went to another chain."""
    route, _, _ = router([span("a", 0, 6, batch_growth=0.28)])
    await route._view.refresh()
    holder = [Hop("a", 0, 6)]
    alone = route.step_cost(holder)
    route._estimates.acquire(holder)  # the first turn's session, kept open for its prefix
    assert route.step_cost(holder) > 1.2 * alone
    assert route.step_cost(holder, idle=holder) == alone
    assert route._estimates.mine["a"] == 1  # still counted for routing every other session
