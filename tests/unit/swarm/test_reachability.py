"""How a peer asks libp2p to make it reachable, what a server says about it at start, and the relay a
reachable peer runs (swarm/nat/reachability.py, swarm/nat/relay_service.py); servers behind emulated NATs in
tests/integration/test_nat.py."""

import argparse
import asyncio

import pytest

from corolla.cli.common import add_swarm_args, swarm_config
from corolla.config import SwarmConfig
from corolla.errors import InvalidRequest
from corolla.swarm.nat.circuit_v2 import reserve
from corolla.swarm.nat.reachability import describe_direct, p2p_options, relays_for_others
from corolla.swarm.nat.relay_service import P2P, expected, keep_own_limits, limit_relaying, relay_limit_flags

RELAY = "/ip4/11.79.0.10/tcp/31330/p2p/12D3KooWRakRqGMCZWZvmwggU793aGxsVVidMZQRoxjCmPvNrR8A"


class Visible:
    """A P2P whose visible addresses are given."""

    def __init__(self, addresses: list[str]):
        self.addresses = addresses

    async def get_visible_maddrs(self, latest: bool = False):
        return self.addresses


def parse(*argv: str) -> SwarmConfig:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_swarm_args(parser, default_host="0.0.0.0")
    return swarm_config(parser.parse_args(list(argv)))


def test_the_options_say_what_libp2p_is_told():
    # a server not said to be behind NAT starts public (and restarts if peers cannot dial it back)
    assert parse().reachability == "auto" and p2p_options(parse()) == {"force_reachability": "public"}
    assert p2p_options(SwarmConfig(client_mode=True)) == {}  # a client: libp2p's own guess
    assert p2p_options(parse("--public")) == {"force_reachability": "public"}
    # reservations are corolla's own (swarm/nat/reservations.py), not the daemon's autorelay
    assert p2p_options(parse("--behind-nat", "--initial-peers", RELAY)) == {"force_reachability": "private"}
    assert p2p_options(parse("--public", "--no-relay")) == {"force_reachability": "public"}
    assert relay_limit_flags(parse("--public", "--no-relay")) == {"relayService": 0}  # the rest is refused
    assert relays_for_others(parse("--public")) and not relays_for_others(parse("--public", "--no-relay"))
    assert relays_for_others(parse()) and not relays_for_others(parse("--behind-nat"))
    assert not relays_for_others(SwarmConfig(client_mode=True))
    assert not relays_for_others(parse("--public", "--host", "127.0.0.1"))  # nobody behind NAT there
    with pytest.raises(argparse.ArgumentError, match="not allowed with argument --public"):
        parse("--public", "--behind-nat")
    with pytest.raises(InvalidRequest, match="reachability must be one of auto, public, behind-nat"):
        SwarmConfig(reachability="sometimes")


def test_relay_limits_are_checked_and_never_for_a_peer_behind_nat():
    limits = ("--relay-time-limit", "20", "--relay-data-limit-mib", "8", "--relay-circuits", "4")
    flags = {"relayTimeLimit": "20.0s", "relayDataLimit": 8 << 20, "relayMaxCircuits": 4}
    assert relay_limit_flags(parse("--public", *limits)) == flags
    assert relay_limit_flags(parse("--public")) == {}  # the daemon's own defaults
    assert relay_limit_flags(parse(*limits)) == flags  # not said: it starts as a relay
    with pytest.raises(
        InvalidRequest, match=r"relay_time_limit \(--relay-time-limit\) must be greater than 0"
    ):
        parse("--public", "--relay-time-limit", "0")
    with pytest.raises(
        InvalidRequest, match=r"relay_circuits \(--relay-circuits\) must be greater than 0, got -1"
    ):
        parse("--public", "--relay-circuits", "-1")
    with pytest.raises(InvalidRequest, match="limits relaying, which a peer --behind-nat never does"):
        parse("--behind-nat", "--relay-data-limit-mib", "8")


def test_a_relays_daemon_is_started_again_until_its_own_limits_answer():
    """The bundled daemon answers reservations with libp2p's built-in limits (120 s, 128 KiB) in most
    starts (swarm/nat/relay_service.py): `keep_own_limits` starts it until its flags' limits answer. Real
    daemons on loopback; this process's P2P class is restored afterwards."""
    config = parse("--public", "--relay-time-limit", "20", "--relay-data-limit-mib", "64")
    want = expected(config)
    assert want == (20, 64 << 20)
    modes, create = {m: dict(f) for m, f in P2P.DHT_MODE_MAPPING.items()}, P2P.create

    async def started() -> list:
        relay = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, force_reachability="public"
        )
        probe = await create(
            initial_peers=[str(a) for a in await relay.get_visible_maddrs()], nat_port_map=False
        )
        try:
            grant = await reserve(probe, str(relay.peer_id), 5)
            return [grant.time_limit, grant.data_limit]
        finally:
            await probe.shutdown()
            await relay.shutdown()

    try:
        limit_relaying(relay_limit_flags(config))
        keep_own_limits(want)
        grants = [asyncio.run(started()) for _ in range(3)]
    finally:
        P2P.DHT_MODE_MAPPING, P2P.create = modes, create
    assert grants == [list(want)] * 3


def test_a_server_reached_directly_says_so_at_start():
    visible = Visible(["/ip4/11.79.0.12/tcp/4000", "/ip4/11.79.0.10/tcp/1/p2p/X/p2p-circuit/p2p/Y"])
    kind, line = asyncio.run(describe_direct(visible, parse("--public"), ""))
    assert kind == "direct" and line == (
        "Reachable directly at /ip4/11.79.0.12/tcp/4000 (and relays for peers behind NAT)"
    )
    kind, line = asyncio.run(describe_direct(visible, parse("--public", "--no-relay"), ""))
    assert line == "Reachable directly at /ip4/11.79.0.12/tcp/4000"
    kind, line = asyncio.run(describe_direct(visible, parse(), "direct"))  # peers dialed it back
    assert kind == "direct" and line.startswith("Reachable directly at /ip4/11.79.0.12/tcp/4000")
    kind, line = asyncio.run(describe_direct(visible, parse(), ""))
    assert kind == "" and line.startswith("Listening at /ip4/11.79.0.12/tcp/4000; whether other peers")
