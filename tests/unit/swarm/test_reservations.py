"""A peer behind NAT keeps reservations on relays (swarm/nat/reservations.py) and others reach it through the
relayed addresses its records announce (swarm/nat/circuit_book.py). Real libp2p daemons on loopback; the peer
"behind NAT" listens on no address at all, so a relay is its only way in. Behind emulated home routers:
tests/integration/test_nat.py."""

import asyncio
import logging

import pytest
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from corolla.config import SwarmConfig
from corolla.errors import ConnectionLost
from corolla.swarm.dht import start_dht
from corolla.swarm.nat import reservations
from corolla.swarm.nat.circuit_book import CircuitBook
from corolla.swarm.nat.circuit_v2 import Address, ReservationFailed, reserve
from corolla.swarm.nat.reservations import Reservations
from corolla.swarm.p2p.transport import P2PTransport, remote_errors
from corolla.wire.records import RelayPath

RELAY_ID = "12D3KooWRakRqGMCZWZvmwggU793aGxsVVidMZQRoxjCmPvNrR8A"
BUILT_IN = (120, 128 << 10)  # libp2p's own relay limits, which a peer not found public grants (relay_service)


async def relay() -> P2P:
    return await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)


async def addresses(p2p: P2P) -> list[str]:
    return [str(address) for address in await p2p.get_visible_maddrs()]


async def behind_nat(initial: list[str]) -> P2P:
    """A peer nobody can dial: it listens nowhere."""
    return await P2P.create(no_listen=True, initial_peers=initial, nat_port_map=False, dht_mode="client")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_nobody_can_dial_is_reached_through_the_relay_its_record_names():
    async def run():
        first = await relay()
        home = await behind_nat(await addresses(first))
        client = await P2P.create(initial_peers=await addresses(first), nat_port_map=False, dht_mode="client")

        async def hello(request, context):
            return runtime_pb2.ExpertInfo(serialized_info=b"from behind NAT")

        await home.add_protobuf_handler("hello", hello, runtime_pb2.ExpertUID)
        try:
            kept = Reservations(home, await addresses(first), lambda: asyncio.sleep(0, []))
            await kept.renew()
            (path,) = kept.paths
            assert kept.reachability == "relayed" and path.relay == str(first.peer_id)
            # a relay on loopback gives no public address: the one the peer dialed it at stands in
            assert path.address == f"{(await addresses(first))[0]}/p2p-circuit"
            assert (path.time_limit, path.data_limit) == BUILT_IN
            book = CircuitBook()
            transport = P2PTransport(client, book)
            request = runtime_pb2.ExpertUID(uid="")
            with pytest.raises(ConnectionLost):  # libp2p alone does not find it
                async with remote_errors(str(home.peer_id), 5):
                    await asyncio.wait_for(
                        transport.call(str(home.peer_id), "hello", request, runtime_pb2.ExpertInfo), 5
                    )
            book.learn(str(home.peer_id), kept.paths)  # what its record says
            reply = await transport.call(str(home.peer_id), "hello", request, runtime_pb2.ExpertInfo)
            assert reply.serialized_info == b"from behind NAT"
            (connection,) = [p for p in await client.list_peers() if p.peer_id == home.peer_id]
            assert all("/p2p-circuit" in str(address) for address in connection.addrs)
            # near the relay's data limit (128 KiB each way here), the connection is made anew first
            assert await book.limit_ahead(client, str(home.peer_id), 1000) is None
            book.count(str(home.peer_id), 0, 120 << 10)
            reason = await book.limit_ahead(client, str(home.peer_id), 1000)
            assert reason.endswith("the relay's limit is 131072 each way")
            assert home.peer_id not in [p.peer_id for p in await client.list_peers()]
            reply = await transport.call(str(home.peer_id), "hello", request, runtime_pb2.ExpertInfo)
            assert reply.serialized_info == b"from behind NAT" and book.traffic[str(home.peer_id)] == [0, 0]
        finally:
            for peer in (client, home, first):
                await peer.shutdown()

    asyncio.run(run())


def test_a_dead_relay_is_replaced_and_each_change_said_in_one_line(caplog):
    """Two initial relays: both held. One dies: dropped at the next renewal, the other still held, the
    change said. The second dies too: a warning that nobody can reach it, with what the owner can do. A
    public server then appears in the records: reserved at the next round."""
    caplog.set_level(logging.INFO, logger="corolla.swarm.nat.reservations")

    async def run():
        relays = [await relay() for _ in range(3)]
        initial = [(await addresses(r))[0] + f"/p2p/{r.peer_id}" for r in relays[:2]]
        home = await behind_nat(initial)
        found: list[str] = []

        async def public() -> list[str]:
            return found

        try:
            kept = Reservations(home, initial, public)
            await kept.renew()
            assert sorted(kept.held) == sorted(str(r.peer_id) for r in relays[:2])
            kept.speak()
            assert caplog.records[-1].message.startswith("Behind NAT, reachable through 2 relay(s)")
            await relays[0].shutdown()
            await kept.renew()
            assert list(kept.held) == [str(relays[1].peer_id)]
            assert caplog.records[-1].message.startswith(f"Relays changed (gone: {relays[0].peer_id}).")
            await relays[1].shutdown()
            await kept.renew()
            assert kept.reachability == "unreachable" and kept.paths == ()
            warning = caplog.records[-1]
            assert warning.levelno == logging.WARNING and "\n" not in warning.message
            assert warning.message.startswith("Behind NAT and no relay holds a reservation (2 asked)")
            assert "--initial-peers of a peer with a public address" in warning.message
            found.append(str(relays[2].peer_id))
            kept._found_at = -float("inf")  # the records are read again now (every FIND_PERIOD)
            where = [Address(address) for address in await addresses(relays[2])]
            await home._client.connect(relays[2].peer_id, where)  # the daemon knows where it is
            await kept.renew()
            assert list(kept.held) == [str(relays[2].peer_id)]
        finally:
            for peer in (home, relays[2]):
                await peer.shutdown()

    asyncio.run(run())


def test_a_relay_that_refuses_is_left_alone_for_a_while():
    """A DHT peer started with --no-relay refuses (libp2p's own relay in its daemon included): not asked
    again for BACKOFF seconds."""
    refusing = start_dht(
        SwarmConfig(host="127.0.0.1", nat_port_map=False, reachability="public", relay=False)
    )

    async def run():
        initial = [str(address) for address in refusing.get_visible_maddrs()]
        home = await behind_nat(initial)
        clock = Clock()
        asked = []
        try:
            with pytest.raises(ReservationFailed, match="the relay refused: permission denied"):
                await reserve(home, str(refusing.peer_id), 5)
            kept = Reservations(home, initial, lambda: asyncio.sleep(0, []), clock)
            original = kept._ask

            async def counted(peer):
                asked.append(peer)
                return await original(peer)

            kept._ask = counted
            await kept.renew()
            clock.now += reservations.BACKOFF / 2
            await kept.renew()
            assert len(asked) == 1 and not kept.held
            clock.now += reservations.BACKOFF
            await kept.renew()
            assert len(asked) == 2
        finally:
            await home.shutdown()

    try:
        asyncio.run(run())
    finally:
        refusing.shutdown()


def test_a_relayed_connection_is_made_anew_before_the_relays_time_limit():
    """The relay's time limit less a margin (10 s, or 5% of longer limits), counted from the connection."""
    clock = Clock()
    book = CircuitBook(clock)
    paths = [RelayPath(f"/ip4/11.79.0.10/tcp/1/p2p/{RELAY_ID}/p2p-circuit", time_limit=30, data_limit=None)]
    assert book._near(paths, 19.9, 10**12) is None
    assert book._near(paths, 20.0, 0) == "its relayed connection is 20 s old, the relay's limit is 30 s"
    long = [RelayPath(paths[0].address, time_limit=1800, data_limit=100)]
    assert book._near(long, 1709, 89) is None and book._near(long, 1710, 0) is not None
    assert book._near(long, 0, 90) is not None  # 90% of the data limit
    book.learn("server", paths)
    assert asyncio.run(book.limit_ahead(None, "server", 0)) is None  # never connected: nothing to move
