"""Servers this client avoids: for a while after a failure, for good once caught lying, or while a dispute
between two of them is undecided.

A failed server is avoided for `ban_time`, doubling with each failure in a row (at most 16x). Failures
reported while it is already avoided are the same failure, seen by other sessions that were on it: they
count once. A server that refused a session for want of cache (CacheExhausted) has not failed: it is
passed over for FULL_TIME, without counting as a failure (corolla sim: banning full servers as failed
ones, while a busy swarm's caches were full, made sessions wait out routing_timeout and be lost as if
their blocks had no server). An avoided server is still pinged (client/routing/swarm_view.py); one that
stopped answering and then answers again (restarted, or resumed) is reinstated at once.

A server a spot check caught computing wrong outputs is avoided for good, and this client's list of such
servers is stored in the DHT (swarm/records/faulty_reports.py) for the swarm's operators, in the background;
clients never act on others' reports. When a check cannot tell which of two sides lied (no third opinion),
both sides are avoided by this client but accused of nothing (`Undecided`), until more servers can decide.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from corolla.config import ClientConfig
from corolla.errors import CacheExhausted

logger = logging.getLogger(__name__)

FULL_TIME = 5.0  # seconds a server that had no cache for a session is passed over
Report = Callable[[dict[str, str]], Awaitable[bool]]  # stores this client's faulty servers in the DHT


@dataclass(frozen=True)
class Undecided:
    """A disagreement over blocks [start, end) between a checked server and its checkers that no other
    server could settle yet."""

    checked: str
    checkers: tuple[str, ...]
    start: int
    end: int

    @property
    def peers(self) -> tuple[str, ...]:
        return (self.checked, *self.checkers)

    def describe(self) -> str:
        checkers = " + ".join(f"...{peer[-6:]}" for peer in self.checkers)
        return (
            f"a dispute between ...{self.checked[-6:]} and {checkers} over blocks {self.start}:{self.end} "
            "is undecided (no other server of these blocks to settle it; neither side is used)"
        )


class Bans:
    def __init__(
        self, config: ClientConfig, report: Report | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.clock = clock  # seconds (corolla.sim runs the bans under a simulated clock)
        self.ban_time = config.ban_time
        self.blocked = frozenset(config.blocked_servers)
        self.faulty: dict[str, str] = {}  # servers caught computing wrong outputs: what they did
        self.undecided: list[Undecided] = []  # disputes no server could settle yet (never reported)
        self._report = report
        self._reporting: asyncio.Future | None = None  # the report being stored
        self._until: dict[str, tuple[float, int]] = {}  # peer id -> (avoided until, failures so far)
        self._down: set[str] = set()  # avoided servers that missed a ping since they failed
        self._full_until: dict[str, float] = {}  # servers out of cache -> passed over until then
        self.settle_disputes: Callable[[], Awaitable[None]] | None = None  # the judge's, if spot checking

    def ban(self, peer_id: str) -> None:
        """Avoid a server that failed, for ban_time, doubling with each failure in a row; a failure
        reported while it is avoided already (another session saw the same one) counts once."""
        until, failures = self._until.get(peer_id, (0.0, 0))
        now = self.clock()
        if until > now:
            return
        duration = self.ban_time * 2 ** min(failures, 4)
        self._until[peer_id] = (now + duration, failures + 1)
        logger.info("Avoiding server ...%s for %.0fs after a failure", peer_id[-6:], duration)

    def failed(self, peer_id: str, error: BaseException | None) -> None:
        """A server failed a request with `error`: banned, unless it only had no cache for it (`full`)."""
        if isinstance(error, CacheExhausted):
            self.full(peer_id)
        else:
            self.ban(peer_id)

    def full(self, peer_id: str) -> None:
        """Pass over a server that had no cache for a session, for FULL_TIME (not a failure)."""
        now = self.clock()
        self._full_until = {peer: until for peer, until in self._full_until.items() if until > now}
        self._full_until[peer_id] = now + FULL_TIME
        logger.info("Server ...%s has no cache left; passing it over for %.0fs", peer_id[-6:], FULL_TIME)

    def out_of_cache(self) -> set[str]:
        """Servers passed over now because they had no cache for a session."""
        now = self.clock()
        return {peer_id for peer_id, until in self._full_until.items() if until > now}

    def avoided(self) -> set[str]:
        """Servers avoided after a failure (now): the ones worth pinging to see whether they are back."""
        now = self.clock()
        return {peer_id for peer_id, (until, _) in self._until.items() if until > now}

    def pinged(self, peer_id: str, answered: bool) -> None:
        """A ping's outcome: an avoided server that missed a ping and answers again is reinstated."""
        if peer_id not in self.avoided():
            self._down.discard(peer_id)
        elif not answered:
            self._down.add(peer_id)
        elif peer_id in self._down:
            self._down.discard(peer_id)
            del self._until[peer_id]
            logger.info("Server ...%s answers again; using it again", peer_id[-6:])

    def ban_for_good(self, peer_id: str, reason: str) -> None:
        """Never use a server again (this client caught it computing wrong outputs)."""
        logger.warning("Server ...%s is faulty and banned for good: %s", peer_id[-6:], reason)
        self.faulty[peer_id] = reason
        if self._report is not None:
            self._reporting = asyncio.ensure_future(self._report(dict(self.faulty)))

    def dispute(self, undecided: Undecided) -> None:
        """Avoid both sides of a dispute no server could settle, accusing neither."""
        logger.warning("Avoiding both sides: %s", undecided.describe())
        self.undecided.append(undecided)

    def settle(self, undecided: Undecided) -> None:
        """A dispute was settled (the judge banned the liar): its sides are no longer avoided for it."""
        if undecided in self.undecided:
            self.undecided.remove(undecided)

    def explain(self, start: int, end: int) -> str:
        """Why blocks [start, end) may lack servers: the undecided disputes over any of them."""
        found = [u.describe() for u in self.undecided if u.start < end and start < u.end]
        return "".join(f"; {what}" for what in found)

    def disputed(self) -> set[str]:
        return {peer_id for undecided in self.undecided for peer_id in undecided.peers}

    def banned(self) -> set[str]:
        return set(self.blocked) | set(self.faulty) | self.avoided() | self.disputed() | self.out_of_cache()

    async def shutdown(self) -> None:
        if self._reporting is not None:
            self._reporting.cancel()
            await asyncio.gather(self._reporting, return_exceptions=True)
