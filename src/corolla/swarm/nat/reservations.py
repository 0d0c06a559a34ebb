"""A peer behind NAT keeps itself reachable: reservations on relays, made and renewed by corolla.

The relays it knows are its initial peers and the servers the swarm's records say are reached directly
(`find_public`, read every round while it holds fewer than WANT); it holds reservations on WANT of them
where that many exist, at once from its start. Every RENEW_PERIOD
seconds it renews each (a relay that fails to answer is dropped, and another taken in its place), which
also keeps its connection to every relay busy, below the idle timeout of a home router's flows. A relay
that refused or failed is not asked again for BACKOFF seconds. Each grant tells the limits the relay puts
on the connections it relays; the server announces its relayed addresses with them (wire/records.py
`RelayPath`), so clients dial it through them (swarm/nat/circuit_book.py) and know when a relay will cut
them. Changes are said in one line, and so is having no relay at all, with what the owner can do.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence

from hivemind.p2p import P2P

from corolla.swarm.nat.circuit_v2 import Grant, ReservationFailed, reserve
from corolla.wire.records import RelayPath

logger = logging.getLogger(__name__)

WANT = 2  # relays to hold reservations on, where that many exist
RENEW_PERIOD = 10.0  # seconds between renewals (and looks for more relays while short of WANT)
RESERVE_TIMEOUT = 5.0
BACKOFF = 60.0  # seconds a relay that refused or failed is left alone
FIND_PERIOD = RENEW_PERIOD  # seconds between reads of the records for public servers, while short of WANT
ADVICE = (
    "give --initial-peers of a peer with a public address (`corolla dht` there relays), or forward a TCP "
    "port to this machine and run with --port PORT --announce-host YOUR_PUBLIC_IP --public"
)


def peer_of(address: str) -> str:
    return address.rsplit("/p2p/", 1)[-1]


class Reservations:
    def __init__(
        self,
        p2p: P2P,
        initial_peers: Sequence[str],
        find_public: Callable[[], Awaitable[Sequence[str]]],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.p2p = p2p
        self.me = str(p2p.peer_id)
        self.initial = [peer_of(address) for address in initial_peers if "/p2p/" in address]
        self.find_public = find_public
        self.clock = clock
        self.held: dict[str, tuple[Grant, tuple[str, ...]]] = {}  # relay -> its grant, our circuits
        self.failed: dict[str, float] = {}  # relay -> when it last refused or failed
        self.found: list[str] = []  # public servers from the records
        self._found_at = -float("inf")
        self._said: tuple[str, ...] | None = None  # the relays the last line named
        self.speaking = False  # lines only once the server serves (`speak`)
        self._rng = random.Random()
        self.changed = asyncio.Event()  # set whenever the relays held change

    @property
    def reachability(self) -> str:
        return "relayed" if self.held else "unreachable"

    @property
    def paths(self) -> tuple[RelayPath, ...]:
        """This peer's relayed addresses, with each relay's limits: what its records announce."""
        return tuple(
            RelayPath(address, grant.time_limit, grant.data_limit)
            for grant, circuits in self.held.values()
            for address in circuits
        )

    async def renew(self) -> bool:
        """One round: renew every reservation held, then take new ones while short of WANT; whether the
        relays held changed."""
        before = set(self.held)
        renewed = await asyncio.gather(*(self._ask(relay) for relay in list(self.held)))
        for relay, grant in zip(list(self.held), renewed, strict=True):
            if grant is None:
                del self.held[relay]
        if len(self.held) < WANT:
            await self._fill()
        changed = set(self.held) != before
        if changed:
            self.changed.set()
        self._say()
        return changed

    async def wait_for_one(self, timeout: float) -> bool:
        """Whether a relay holds a reservation within `timeout` seconds."""
        deadline = self.clock() + timeout
        while not self.held and (left := deadline - self.clock()) > 0:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except (asyncio.TimeoutError, TimeoutError):
                break
        return bool(self.held)

    async def _fill(self) -> None:
        now = self.clock()
        if now - self._found_at >= FIND_PERIOD and len(self._candidates(now)) < WANT - len(self.held):
            self._found_at = now
            try:
                found = await asyncio.wait_for(self.find_public(), RESERVE_TIMEOUT * 3)
                self.found = [peer for peer in found if peer != self.me]
            except Exception as e:  # the DHT may be unreachable for a moment: the next round reads again
                logger.debug("Could not read the swarm's public servers: %s", e)
        for relay in self._candidates(now):
            if len(self.held) >= WANT:
                break
            await self._direct_to(relay)
            await self._ask(relay)

    def _candidates(self, now: float) -> list[str]:
        """Relays to ask, initial peers first (they are there from the start), in a random order."""
        fresh = [
            peer
            for peer in dict.fromkeys([*self.initial, *self.found])
            if peer not in self.held and now - self.failed.get(peer, -BACKOFF) >= BACKOFF and peer != self.me
        ]
        initial = [peer for peer in fresh if peer in self.initial]
        found = [peer for peer in fresh if peer not in self.initial]
        self._rng.shuffle(initial)
        self._rng.shuffle(found)
        return initial + found

    async def _ask(self, relay: str) -> Grant | None:
        try:
            grant = await reserve(self.p2p, relay, RESERVE_TIMEOUT)
        except ReservationFailed as e:
            if relay in self.held:
                logger.info("Relay ...%s no longer holds this server's reservation (%s)", relay[-6:], e)
            else:
                logger.debug("Relay ...%s gave no reservation: %s", relay[-6:], e)
            self.failed[relay] = self.clock()
            return None
        fallback = None if grant.addresses else await self._dialed_address(relay)
        circuits = grant.circuits(fallback)
        if not circuits:
            self.failed[relay] = self.clock()  # nobody could dial it through this relay
            return None
        self.held[relay] = (grant, circuits)
        return grant

    async def _direct_to(self, relay: str) -> None:
        """Before a first reservation: a relay refuses one asked over a relayed connection, which a public
        server may have opened to this peer (to ping it, to push to it); that one is closed, and the daemon
        dials the relay directly at the next stream."""
        for peer in await self.p2p.list_peers():
            if str(peer.peer_id) == relay and all("/p2p-circuit" in str(a) for a in peer.addrs):
                await self.p2p._client.disconnect(peer.peer_id)

    async def _dialed_address(self, relay: str) -> str | None:
        """The address of our direct connection to a relay that gave no public address of its own."""
        for peer in await self.p2p.list_peers():
            if str(peer.peer_id) == relay:
                direct = [str(a) for a in peer.addrs if "/p2p-circuit" not in str(a) and "/tcp/" in str(a)]
                return direct[0].split("/p2p/")[0] if direct else None
        return None

    def speak(self) -> None:
        """Say how this peer is reached now, and from now on whenever that changes."""
        self.speaking = True
        self._say()

    def _say(self) -> None:
        relays = tuple(sorted(self.held))
        if not self.speaking or relays == self._said:
            return
        if relays:
            path = self.paths[0]
            message = (
                f"Behind NAT, reachable through {len(relays)} relay(s) ({', '.join(relays)}); "
                f"{describe_limits(path.time_limit, path.data_limit)}: {path.address}/p2p/{self.me}"
            )
            if self._said:
                gone = ", ".join(sorted(set(self._said) - set(relays))) or "none"
                message = f"Relays changed (gone: {gone}). {message}"
            logger.info(message)
        else:
            asked = len(dict.fromkeys([*self.initial, *self.found]))
            logger.warning(
                "Behind NAT and no relay holds a reservation (%d asked): no client can reach this server; %s",
                asked,
                ADVICE,
            )
        self._said = relays


def describe_limits(time_limit: int | None, data_limit: int | None) -> str:
    seconds = "no time limit" if time_limit is None else f"{time_limit} s"
    data = "no data limit" if data_limit is None else f"{data_limit / 2**20:.4g} MiB each way"
    return f"each relayed connection {seconds}, {data}"
