"""Servers this client avoids: for a while after a failure, or for good once caught lying.

A failed server is avoided for `ban_time`, doubling with each failure in a row (at most 16x). A server a
spot check caught computing wrong outputs is avoided for good, and this client's list of such servers is
stored in the DHT (swarm/reports.py) for the swarm's operators, in the background; clients never act on
others' reports.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from corolla.config import ClientConfig

logger = logging.getLogger(__name__)

Report = Callable[[dict[str, str]], Awaitable[bool]]  # stores this client's faulty servers in the DHT


class Bans:
    def __init__(self, config: ClientConfig, report: Report | None = None):
        self.ban_time = config.ban_time
        self.blocked = frozenset(config.blocked_servers)
        self.faulty: dict[str, str] = {}  # servers caught computing wrong outputs: what they did
        self._report = report
        self._reporting: asyncio.Future | None = None  # the report being stored
        self._until: dict[str, tuple[float, int]] = {}  # peer id -> (avoided until, failures so far)

    def ban(self, peer_id: str) -> None:
        """Avoid a server that failed, for ban_time, doubling with each failure in a row."""
        _, failures = self._until.get(peer_id, (0.0, 0))
        duration = self.ban_time * 2 ** min(failures, 4)
        self._until[peer_id] = (time.monotonic() + duration, failures + 1)
        logger.info("Avoiding server ...%s for %.0fs after a failure", peer_id[-6:], duration)

    def ban_for_good(self, peer_id: str, reason: str) -> None:
        """Never use a server again (this client caught it computing wrong outputs)."""
        logger.warning("Server ...%s is faulty and banned for good: %s", peer_id[-6:], reason)
        self.faulty[peer_id] = reason
        if self._report is not None:
            self._reporting = asyncio.ensure_future(self._report(dict(self.faulty)))

    def banned(self) -> set[str]:
        now = time.monotonic()
        avoided = {peer_id for peer_id, (until, _) in self._until.items() if until > now}
        return set(self.blocked) | set(self.faulty) | avoided

    async def shutdown(self) -> None:
        if self._reporting is not None:
            self._reporting.cancel()
            await asyncio.gather(self._reporting, return_exceptions=True)
