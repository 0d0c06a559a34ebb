"""How a peer asks libp2p to make it reachable, and what a server says about it at start
(swarm/reachability.py); served through a relay behind an emulated NAT in tests/integration/test_nat.py."""

import argparse
import asyncio
import logging
from types import SimpleNamespace

import pytest

from corolla.cli.common import add_swarm_args, swarm_config
from corolla.config import SwarmConfig
from corolla.errors import InvalidRequest
from corolla.swarm.reachability import RelayWatch, describe, p2p_options

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
