"""The spans a server hosts, and their moves: the one owner of the server's backends.

Requests name blocks by uid; `select` finds the backend hosting them. A server holds one backend, two
while it moves (server/upkeep/rebalancer.py decides when): `move_to` loads and starts the new span first, then
the old one stops taking new sessions and forward requests, serves the sessions it has until they end
(at most the drain timeout), and is unloaded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from corolla.engine.engine import EngineStats
from corolla.errors import InvalidRequest, ServerUnavailable
from corolla.server import validation
from corolla.server.hosting.backend import SpanBackend
from corolla.server.inference.sessions import ServerSession

logger = logging.getLogger(__name__)

RETIRE_POLL_SECONDS = 0.5


class HostedSpans:
    def __init__(
        self,
        dht_prefix: str,
        load: Callable[[tuple[int, int]], Awaitable[SpanBackend]],
        adapters: frozenset[str] = frozenset(),
        drain_timeout: float = 60.0,
    ):
        self.dht_prefix = dht_prefix
        self.adapters = adapters
        self.drain_timeout = drain_timeout
        self._load = load
        self._backends: list[SpanBackend] = []  # the accepting one first
        self._retiring: set[asyncio.Task] = set()

    async def start(self, blocks: tuple[int, int]) -> None:
        self._backends.append(await self._load(blocks))

    @property
    def backends(self) -> tuple[SpanBackend, ...]:
        return tuple(self._backends)

    @property
    def primary(self) -> SpanBackend:
        """The backend that takes new sessions (the newest one while moving)."""
        return next((b for b in self._backends if b.accepting), self._backends[0])

    @property
    def is_moving(self) -> bool:
        return len(self._backends) > 1

    @property
    def num_sessions(self) -> int:
        return sum(len(backend.sessions) for backend in self._backends)

    def engine_stats(self) -> list[EngineStats]:
        """Every hosted span's last engine snapshot, the primary's first (safe from any thread)."""
        backends = sorted(self.backends, key=lambda b: b is not self.primary)
        return [backend.engine.stats for backend in backends]

    def select(self, uid: str, new_session: bool) -> tuple[SpanBackend, tuple[int, int]]:
        """The backend hosting the blocks named by `uid`; new sessions go only to an accepting one."""
        error: InvalidRequest | None = None
        for backend in sorted(self._backends, key=lambda b: not b.accepting):
            try:
                blocks = validation.parse_uid(uid, self.dht_prefix, *backend.blocks)
                # Gemma's layers that reuse an earlier layer's keys and values: never without it
                config = backend.span.config
                config.kv_sharing.check_span(*blocks, config.model_type)
            except InvalidRequest as e:
                error = error or e
                continue
            if new_session and not backend.accepting:
                raise ServerUnavailable(f"this server is moving away from blocks {blocks[0]}:{blocks[1]}")
            return backend, blocks
        raise error

    def find_session(self, owner: str | None, session_id: str | None) -> ServerSession | None:
        """The session `session_id` opened by peer `owner`, if it is open here."""
        for backend in self._backends:
            session = backend.sessions.get(owner, session_id)
            if session is not None:
                return session
        return None

    def check_adapter(self, adapter: str | None) -> None:
        if adapter is not None and adapter not in self.adapters:
            served = ", ".join(sorted(self.adapters)) or "none"
            raise InvalidRequest(f"active_adapter {adapter!r} is not served here (adapters here: {served})")

    async def move_to(self, blocks: tuple[int, int]) -> SpanBackend:
        """Serve `blocks` instead: the new span first; returns the old one, which retires on its own."""
        old = self._backends[0]
        logger.info("Moving from blocks %d:%d to %d:%d to balance the swarm", *old.blocks, *blocks)
        new = await self._load(blocks)
        old.accepting = False
        self._backends.insert(0, new)
        task = asyncio.create_task(self._retire(old))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        return old

    async def _retire(self, old: SpanBackend) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        if len(old.sessions):
            logger.info(
                "Blocks %d:%d retire once their %d sessions end (at most %.0fs)",
                *old.blocks,
                len(old.sessions),
                self.drain_timeout,
            )
        while len(old.sessions) and loop.time() < deadline:
            await asyncio.sleep(RETIRE_POLL_SECONDS)
        if len(old.sessions):
            logger.warning(
                "%d sessions on blocks %d:%d outlived the move's drain timeout; they will fail over",
                len(old.sessions),
                *old.blocks,
            )
        self._backends.remove(old)
        await old.stop()
        logger.info("Unloaded blocks %d:%d", *old.blocks)

    async def stop(self) -> None:
        for task in self._retiring:
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        for backend in self._backends:
            await backend.stop()
            stats = backend.engine.stats
            logger.info(
                "Engine ran %d passes, %.1f rows per pass on average",
                stats.num_passes,
                stats.total_rows / max(stats.num_passes, 1),
            )
