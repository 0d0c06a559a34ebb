"""The relay a reachable peer runs for peers behind NAT: libp2p's circuit relay v2 inside its daemon, with
corolla's limits, checked to be the ones it grants.

The bundled p2pd starts two relay services: one with the limits of its flags (`-relayTimeLimit` and so
on) once the peer is (or is forced) public, and one with libp2p's built-in limits (2 minutes and 128 KiB
each way per relayed connection: less than one prompt of a real model), always; whichever registers last
answers every reservation and circuit. Measured with the bundled daemon forced public: its flags' limits
answered in 5 of 40 starts (3 of 30 inside a DHT peer). So in a relaying peer's DHT process
`keep_own_limits` checks each new daemon with a reservation from a throwaway peer (swarm/nat/circuit_v2.py)
and starts it again until its own limits answer: about 0.14 s a start, 8 starts on average. A peer left to
libp2p's AutoNAT would get the flags' service only once AutoNAT finds it public, which needs another
public peer to dial it back (never, in a swarm whose only public peer it is), and would then drop every
reservation it held.

hivemind's `P2P.create` has no argument for the limits: it reads a forced reachability's daemon flags
from a class table, which `limit_relaying` changes in the DHT's child process only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import varint
from hivemind.dht import DHT, DHTNode
from hivemind.p2p import P2P, PeerID

from corolla.config import SwarmConfig
from corolla.swarm.nat.circuit_v2 import (
    HOP,
    PERMISSION_DENIED,
    Address,
    Grant,
    HopMessage,
    read_message,
    reserve,
)

logger = logging.getLogger(__name__)

DEFAULT_TIME_LIMIT = 1800  # seconds: the daemon's -relayTimeLimit default
DEFAULT_DATA_LIMIT_MIB = 4096  # the daemon's -relayDataLimit default
CHECK_TIMEOUT = 5.0
MAX_STARTS = 64  # daemon starts until its own limits answer (each does with odds of about 1/8)


def relay_limit_flags(config: SwarmConfig) -> dict[str, Any]:
    """The libp2p daemon's flags for the limits of what this peer relays, when it does (those set); for
    one that relays for nobody, its flags' relay service off (libp2p's own is refused: `refuse_relaying`)."""
    if not config.relay:
        return {"relayService": 0}
    flags = {
        "relayTimeLimit": None if config.relay_time_limit is None else f"{config.relay_time_limit}s",
        "relayDataLimit": None if config.relay_data_limit_mib is None else config.relay_data_limit_mib << 20,
        "relayMaxCircuits": config.relay_circuits,
    }
    return {flag: value for flag, value in flags.items() if value is not None}


def limit_relaying(flags: dict[str, Any]) -> None:
    """In a DHT peer's child process, before it starts its daemon: pass `flags` to the daemon."""
    P2P.DHT_MODE_MAPPING = {
        mode: {**mode_flags, **flags} for mode, mode_flags in P2P.DHT_MODE_MAPPING.items()
    }


async def refuse_relaying(dht: DHT, node: DHTNode) -> None:
    """In a DHT peer's process (`dht.run_coroutine`): answer every request to relay with "permission
    denied". The daemon's relay with libp2p's built-in limits starts whatever its flags say (`-relay=0`
    does not stop it, measured); a stream handler registered later replaces its handler."""

    async def refuse(_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(read_message(reader), CHECK_TIMEOUT)  # the request, whatever it is
            body = HopMessage(type=2, status=PERMISSION_DENIED).SerializeToString()  # STATUS
            writer.write(varint.encode(len(body)) + body)
            await writer.drain()
        except Exception as e:  # a peer that sends garbage or goes away gets nothing more
            logger.debug("A request to relay ended: %s", e)
        finally:
            writer.close()

    await node.p2p.add_binary_stream_handler(HOP, refuse)


def expected(config: SwarmConfig) -> tuple[int, int]:
    """The limits (seconds, bytes each way) this peer's relay should grant a relayed connection."""
    seconds = DEFAULT_TIME_LIMIT if config.relay_time_limit is None else round(config.relay_time_limit)
    mib = DEFAULT_DATA_LIMIT_MIB if config.relay_data_limit_mib is None else config.relay_data_limit_mib
    return seconds, mib << 20


def keep_own_limits(want: tuple[int, int]) -> None:
    """In a relaying peer's DHT process, before hivemind starts its daemon: every daemon `P2P.create`
    starts there is started again until its relay grants `want` (at most MAX_STARTS times)."""
    original = P2P.create

    async def create(*args: Any, **kwargs: Any) -> P2P:
        probe = await _probe(kwargs.get("host_maddrs") or ["/ip4/127.0.0.1/tcp/0"], original)
        try:
            for starts in range(1, MAX_STARTS + 1):
                p2p = await original(*args, **kwargs)
                addresses = [str(address) for address in await p2p.get_visible_maddrs()]
                grant = await _ask_own_relay(probe, str(p2p.peer_id), addresses)
                if grant is not None and (grant.time_limit, grant.data_limit) == want:
                    logger.info(
                        "Relaying for peers behind NAT: each relayed connection at most %d s and %d MiB each "
                        "way (checked after %d start(s) of the libp2p daemon)",
                        want[0],
                        want[1] >> 20,
                        starts,
                    )
                    return p2p
                if starts == MAX_STARTS:
                    logger.warning(
                        "This peer's libp2p daemon relays with libp2p's built-in limits (2 minutes, 128 KiB "
                        "each way per relayed connection) instead of %d s and %d MiB after %d starts",
                        want[0],
                        want[1] >> 20,
                        starts,
                    )
                    return p2p
                await p2p.shutdown()
        finally:
            await probe.shutdown()
        raise AssertionError("unreachable")  # the loop returns

    P2P.create = create


async def _probe(host_maddrs: list, create: Any) -> P2P:
    """A throwaway peer that asks a relay on `host_maddrs` for reservations, listening where it does."""
    host = str(host_maddrs[0]).rsplit("/tcp/", 1)[0] + "/tcp/0"
    return await create(
        host_maddrs=[host], dht_mode="client", nat_port_map=False, force_reachability="private"
    )


async def _ask_own_relay(probe: P2P, peer_id: str, addresses: list[str]) -> Grant | None:
    # a loopback address when it listens on one
    address = next((a for a in addresses if a.startswith("/ip4/127.")), addresses[0])
    try:
        await probe._client.connect(PeerID.from_base58(peer_id), [Address(address.split("/p2p/")[0])])
        return await reserve(probe, peer_id, CHECK_TIMEOUT)
    except Exception:  # a daemon that cannot be reached from here refused nothing: start it again
        return None
