"""Dial-back requests (swarm/nat/dial_back.py) and what a server concludes from the answers
(swarm/nat/joining.py): between real libp2p daemons on loopback; behind an emulated NAT in
tests/integration/test_nat.py."""

import asyncio
from functools import partial

import pytest
from hivemind.dht import DHT, DHTNode
from hivemind.p2p import P2P, P2PContext

from corolla.config import SwarmConfig
from corolla.errors import InvalidRequest
from corolla.swarm.dht import start_dht, visible_addresses
from corolla.swarm.nat.dial_back import MAX_PER_HOST, Answer, DialBackService, direct_hosts, read_ports
from corolla.swarm.nat.joining import checked, join, publish
from corolla.wire.fields import pack

ME = "12D3KooWB34BKL7PKe1HK82QCd6UXhZunXNUoZqGNeG6UaB8Hfon"


def test_a_request_names_a_few_ports_and_nothing_else():
    assert read_ports(pack({"ports": [4000, 4000, 4001]})) == (4000, 4001)
    for ports in ([], [0], [70000], ["80"], [True], [1, 2, 3, 4, 5]):
        with pytest.raises(InvalidRequest, match="'ports'"):
            read_ports(pack({"ports": ports}))
    with pytest.raises(InvalidRequest, match="not valid msgpack"):
        read_ports(b"\xc1")


def test_only_the_addresses_of_direct_connections_are_dialed():
    relayed = f"/ip4/11.79.0.10/tcp/31330/p2p/{ME}/p2p-circuit"
    addresses = ["/ip4/11.79.0.103/tcp/4000", relayed, "/ip6/::1/tcp/4000", "/dns4/example.com/tcp/1"]
    assert direct_hosts(addresses) == ["11.79.0.103", "::1"]
    assert direct_hosts([relayed]) == []


def test_a_malformed_answer_is_refused():
    answer = Answer(("/ip4/1.2.3.4/tcp/5",), ("/ip4/1.2.3.4/tcp/5",))
    assert Answer.from_bytes(answer.to_bytes()) == answer
    with pytest.raises(InvalidRequest, match="'dialed' must hold addresses"):
        Answer.from_bytes(pack({"dialed": [5]}))


async def _two_peers() -> tuple[P2P, P2P]:
    answering = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    maddrs = [str(m) for m in await answering.get_visible_maddrs()]
    asking = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, initial_peers=maddrs)
    return answering, asking


def test_peers_dial_back_a_listening_peer_and_not_a_closed_port():
    async def run() -> None:
        answering, asking = await _two_peers()
        try:
            service = DialBackService(answering)
            await service.register()
            check = await checked(asking, [str(m) for m in await answering.get_visible_maddrs()])
            port = str(await asking.get_visible_maddrs()).split("/tcp/")[1].split("/")[0]
            assert check.kind == "direct" and check.dialed == (f"/ip4/127.0.0.1/tcp/{port}",)
            # a port where something else listens (no libp2p header) is not this peer
            silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
            other = silent.sockets[0].getsockname()[1]
            context = P2PContext("dial-back", answering.peer_id, asking.peer_id)
            answer = await service.answer(pack({"ports": [other]}), context)
            assert answer.tried == (f"/ip4/127.0.0.1/tcp/{other}",) and answer.dialed == ()
            silent.close()
            # a peer not connected is not dialed, whatever it asks
            stranger = P2PContext("dial-back", answering.peer_id, answering.peer_id)
            assert "no direct connection" in (await service.answer(pack({"ports": [1]}), stranger)).refused
            answers = [await service.answer(pack({"ports": [1]}), context) for _ in range(MAX_PER_HOST)]
            assert answers[-1].refused.startswith("too many dial-back requests")  # one was made above
            check = await checked(asking, [f"/ip4/127.0.0.1/tcp/1/p2p/{answering.peer_id}"])
            assert check.kind == "" and check.asked == 1 and check.answered == 0
        finally:
            await asking.shutdown()
            await answering.shutdown()

    asyncio.run(run())


async def _knows(dht: DHT, node: DHTNode, peer_id) -> bool:
    return node.protocol.routing_table.get(peer_id=peer_id) is not None


def test_a_server_enters_the_routing_tables_only_once_peers_dialed_it_back():
    first = start_dht(SwarmConfig(host="127.0.0.1", nat_port_map=False, reachability="public"))
    config = SwarmConfig(host="127.0.0.1", nat_port_map=False, initial_peers=tuple(visible_addresses(first)))
    started = []
    try:
        # unconfirmed (as a server that may turn out to be behind NAT): it reads and asks, nobody lists it
        started.append(unconfirmed := start_dht(config, unconfirmed=True))
        assert not first.run_coroutine(partial(_knows, peer_id=unconfirmed.peer_id))
        unconfirmed.run_coroutine(publish)
        assert first.run_coroutine(partial(_knows, peer_id=unconfirmed.peer_id))
        # join at a loopback address asks nobody (every peer that can reach it at all can): a full node at
        # once; join after a dial-back (tests/integration/test_nat.py: hosts of their own) publishes as above
        joined, _, kind = join(config)
        started.append(joined)
        assert kind == "direct" and first.run_coroutine(partial(_knows, peer_id=joined.peer_id))
    finally:
        for dht in [*started, first]:
            dht.shutdown()


def test_a_peer_at_a_loopback_address_is_direct_without_asking():
    """Only peers on its own host can reach it, and all of them can: no dial-back is asked (under load one
    could time out and strand a test swarm's server behind a NAT that does not exist, with no relay on
    loopback), even of initial peers that would not answer one (plain hivemind here)."""
    plain = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        peers = tuple(str(address) for address in plain.get_visible_maddrs())
        joined, config, kind = join(SwarmConfig(host="127.0.0.1", nat_port_map=False, initial_peers=peers))
        joined.shutdown()
        assert kind == "direct" and config.reachability == "auto"
    finally:
        plain.shutdown()
