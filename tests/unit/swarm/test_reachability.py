"""How a peer asks libp2p to make it reachable, and what a server says about it at start
(swarm/reachability.py); served through a relay behind an emulated NAT in tests/integration/test_nat.py."""

import argparse
import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from corolla.cli.common import add_swarm_args, swarm_config
from corolla.config import SwarmConfig
from corolla.errors import InvalidRequest
from corolla.swarm.dht import start_dht
from corolla.swarm.reachability import P2P, RelayWatch, describe, p2p_options, relay_limit_flags

RELAY = "/ip4/11.79.0.10/tcp/31330/p2p/12D3KooWRakRqGMCZWZvmwggU793aGxsVVidMZQRoxjCmPvNrR8A"
ME = "12D3KooWB34BKL7PKe1HK82QCd6UXhZunXNUoZqGNeG6UaB8Hfon"


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
    assert parse().reachability == "auto" and p2p_options(parse()) == {}
    assert p2p_options(parse("--public")) == {"force_reachability": "public"}
    behind = parse("--behind-nat", "--initial-peers", RELAY)
    assert p2p_options(behind) == {
        "force_reachability": "private",
        "use_auto_relay": True,
        "trusted_relays": [RELAY],
    }
    with pytest.raises(argparse.ArgumentError, match="not allowed with argument --public"):
        parse("--public", "--behind-nat")
    with pytest.raises(InvalidRequest, match="reachability must be one of auto, public, behind-nat"):
        SwarmConfig(reachability="sometimes")


def test_relay_limits_are_checked_and_never_for_a_peer_behind_nat():
    limits = ("--relay-time-limit", "20", "--relay-data-limit-mib", "8", "--relay-circuits", "4")
    flags = {"relayTimeLimit": "20.0s", "relayDataLimit": 8 << 20, "relayMaxCircuits": 4}
    assert relay_limit_flags(parse("--public", *limits)) == flags
    assert relay_limit_flags(parse("--public")) == {}  # the daemon's own defaults
    assert relay_limit_flags(parse(*limits)) == flags  # found reachable, libp2p makes it a relay too
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


def test_a_public_peers_relay_limits_reach_its_libp2p_daemon():
    """A real DHT peer: its daemon (the DHT process's child) runs with the limits; this process's P2P
    class, whose table carries them there, is left as it was."""
    modes = {mode: dict(flags) for mode, flags in P2P.DHT_MODE_MAPPING.items()}
    config = SwarmConfig(
        host="127.0.0.1", nat_port_map=False, reachability="public", relay_time_limit=20, relay_circuits=4
    )
    dht = start_dht(config)
    try:
        children = Path(f"/proc/{dht.pid}/task/{dht.pid}/children").read_text().split()
        commands = [Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0") for child in children]
        (daemon,) = [c for c in commands if c[0].endswith(b"p2pd")]
        assert b"-forceReachabilityPublic=1" in daemon
        assert b"-relayTimeLimit=20s" in daemon and b"-relayMaxCircuits=4" in daemon
        assert not any(arg.startswith(b"-relayDataLimit") for arg in daemon)  # not set: the default
    finally:
        dht.shutdown()
    assert modes == P2P.DHT_MODE_MAPPING


def test_a_server_behind_nat_names_its_relay_or_says_clearly_that_none_took_it():
    config = SwarmConfig(reachability="behind-nat", initial_peers=(RELAY,))
    relayed = f"{RELAY}/p2p-circuit/p2p/{ME}"
    kind, line = asyncio.run(describe(Visible([f"/ip4/10.89.1.2/tcp/4000/p2p/{ME}", relayed]), config, "", 1))
    assert kind == "relayed" and line == (
        "Behind NAT, reachable through 1 relay(s) (12D3KooWRakRqGMCZWZvmwggU793aGxsVVidMZQRoxjCmPvNrR8A): "
        f"{relayed}"
    )
    kind, line = asyncio.run(describe(Visible([f"/ip4/10.89.1.2/tcp/4000/p2p/{ME}"]), config, "", 0.6))
    assert kind == "unreachable" and "\n" not in line
    assert line.startswith("Behind NAT and no relay took a reservation within 1s: no client can reach")
    visible = Visible(["/ip4/11.79.0.12/tcp/4000"])
    kind, line = asyncio.run(describe(visible, parse("--public"), "", 0))
    assert kind == "direct" and line == "Reachable directly at /ip4/11.79.0.12/tcp/4000"
    assert asyncio.run(describe(visible, parse(), "direct", 0)) == (kind, line)  # peers dialed it back
    kind, line = asyncio.run(describe(visible, parse(), "", 0))
    assert kind == "" and line.startswith("Listening at /ip4/11.79.0.12/tcp/4000; whether other peers")


def test_a_server_behind_nat_says_when_its_relays_change(caplog):
    other = RELAY.replace("31330", "31331").rsplit("/p2p/", 1)[0] + "/p2p/" + ME  # a relay with another id
    caplog.set_level("INFO", logger="corolla.swarm.reachability")
    p2p = Visible([f"{RELAY}/p2p-circuit/p2p/{ME}"])
    status = SimpleNamespace(reachability="relayed")
    watch = RelayWatch(p2p, status)
    asyncio.run(watch.check())
    assert caplog.records == [] and status.reachability == "relayed"
    p2p.addresses = [f"{other}/p2p-circuit/p2p/{ME}"]  # the first relay died, libp2p took another
    asyncio.run(watch.check())
    assert (
        caplog.records[-1].message
        == f"Relays changed (gone: {RELAY.rsplit('/', 1)[1]}); reachable through {ME}"
    )
    p2p.addresses = ["/ip4/10.89.1.2/tcp/4000"]
    asyncio.run(watch.check())
    assert caplog.records[-1].levelno == logging.WARNING and status.reachability == "unreachable"
    assert caplog.records[-1].message.startswith(f"No relay holds a reservation now (gone: {ME})")
    p2p.addresses = [f"{RELAY}/p2p-circuit/p2p/{ME}"]
    asyncio.run(watch.check())
    assert status.reachability == "relayed"
