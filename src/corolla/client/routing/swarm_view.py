"""Who serves what, as this client sees it: the servers' records, and which of them answered.

A background task re-reads the DHT and pings every server (rpc_info: round-trip time and live load)
every `refresh_period`; servers avoided after a failure are pinged too, in the background, so that one
that comes back is reinstated (client/routing/bans.py). A record alone (any peer can sign one for itself)
never makes a server: only servers that answered a ping are `answered`. Servers announcing another model under
the same prefix are set apart (`mismatched`); a private swarm's servers that refuse this peer say why
(`refusals`); records the DHT read refused are counted by reason (`rejected_records`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection

from corolla.client.routing.bans import Bans
from corolla.client.routing.estimates import ServerEstimates
from corolla.client.rpc.peers import Peers
from corolla.config import ClientConfig
from corolla.swarm.dht import RemoteSpan
from corolla.wire.records import ServerStatus

logger = logging.getLogger(__name__)

# reads every span of the model from the DHT, counting the records it refuses (by reason) in the tally
SpanReader = Callable[[Counter], Awaitable[list[RemoteSpan]]]


class SwarmView:
    def __init__(
        self,
        config: ClientConfig,
        model_fingerprint: str,
        read_spans: SpanReader,
        peers: Peers,
        estimates: ServerEstimates,
        bans: Bans,
    ):
        self.refresh_period = config.refresh_period
        self.model_fingerprint = model_fingerprint
        self.spans: list[RemoteSpan] = []
        self.answered: set[str] = set()  # servers that answered rpc_info: the only ones routed to
        self.refusals: dict[str, str] = {}  # servers of a private swarm that refuse this peer: why
        self.mismatched: dict[str, RemoteSpan] = {}  # peer id -> the last record of such a server
        self.rejected_records: Counter[str] = Counter()  # unsigned or malformed records read, by reason
        self.refreshed_at = 0.0
        self._statuses: dict[str, ServerStatus] = {}
        self._read_spans = read_spans
        self._peers = peers
        self._estimates = estimates
        self._bans = bans
        self._refresher: asyncio.Task | None = None
        self._refreshing: asyncio.Future | None = None  # the refresh in progress, shared by its callers
        self._probing: asyncio.Future | None = None  # pings of avoided servers: are they back?
        self._settling: set[asyncio.Task] = set()  # further pings of servers met for the first time

    def start(self) -> None:
        """Read the swarm at once (a first session finds the servers read, connected and pinged), then every
        `refresh_period`."""
        self._refresher = asyncio.create_task(self._refresh_forever(), name="corolla-swarm-refresh")

    async def shutdown(self) -> None:
        for task in (self._refresher, self._refreshing, self._probing, *self._settling):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    @property
    def stale(self) -> bool:
        """Due for a refresh, or in the first one before any server answered (a first session waits)."""
        first = not self.answered and self._refreshing is not None and not self._refreshing.done()
        return first or time.monotonic() - self.refreshed_at > self.refresh_period or not self.spans

    def status_of(self, peer_id: str) -> ServerStatus | None:
        """A server's record as last read from the DHT (None: not seen)."""
        return self._statuses.get(peer_id)

    async def refresh(self) -> list[RemoteSpan]:
        """Re-read the DHT and ping every server found (round-trip time, live load).

        Concurrent callers (a burst of new sessions) share one refresh: parallel rounds of pings would
        queue behind each other and inflate the very round trips they measure.
        """
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._refresh())
        return await asyncio.shield(self._refreshing)

    async def ping_silent(self, avoid: Collection[str] = ()) -> bool:
        """Ping again the servers that have not answered yet; whether any of them answered now."""
        skip = self._bans.banned() | set(avoid) | self.answered
        silent = {s.peer_id for s in self.spans if s.peer_id not in skip}
        await asyncio.gather(*(self._ping(peer_id) for peer_id in silent))
        return bool(silent & self.answered)

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a DHT hiccup; the next round tries again
                logger.debug("Background refresh failed", exc_info=True)
            await asyncio.sleep(self.refresh_period)

    async def _refresh(self) -> list[RemoteSpan]:
        spans = [span for span in await self._read_spans(self.rejected_records) if self._same_model(span)]
        self.spans = spans
        self._statuses = {span.peer_id: span.info for span in spans}
        self.refreshed_at = time.monotonic()
        banned = self._bans.banned()
        self._probe({s.peer_id for s in spans} & self._bans.avoided())
        await asyncio.gather(*(self._ping(s.peer_id) for s in spans if s.peer_id not in banned))
        return spans

    def _probe(self, avoided: set[str]) -> None:
        """Ping servers avoided after a failure, in the background (a dead one takes a ping's timeout)."""
        avoided -= self._bans.disputed()
        if avoided and (self._probing is None or self._probing.done()):
            self._probing = asyncio.ensure_future(asyncio.gather(*(self._ping(p) for p in avoided)))

    async def _ping(self, peer_id: str) -> None:
        first = not self._estimates.has_rtt(peer_id)
        if await self._ping_once(peer_id) and first:
            # one round trip alone is noise (the first one also opened the connection): a server met for
            # the first time gets two more, in the background, so that a first session waits for one
            task = asyncio.create_task(self._ping_again(peer_id, 2))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def _ping_again(self, peer_id: str, times: int) -> None:
        for _ in range(times):
            if not await self._ping_once(peer_id):
                return

    async def _ping_once(self, peer_id: str) -> bool:
        """One ping; whether the server answered."""
        answer = await self._peers.ping(peer_id)
        self._bans.pinged(peer_id, answer.answered)
        if not answer.answered:
            if answer.refusal is not None:
                self.refusals[peer_id] = answer.refusal
            return False  # unreachable now: its steps will fail over if it is used anyway
        self.refusals.pop(peer_id, None)
        self._estimates.ping(peer_id, answer.seconds, answer.status)
        self.answered.add(peer_id)
        return True

    def _same_model(self, span: RemoteSpan) -> bool:
        if span.info.serves_model(self.model_fingerprint):
            return True
        if span.peer_id not in self.mismatched:
            logger.warning(
                "Ignoring server ...%s: it announces blocks %d:%d for another model (fingerprint %s, this "
                "model's is %s)",
                span.peer_id[-6:],
                span.start,
                span.end,
                span.info.model_fingerprint,
                self.model_fingerprint,
            )
        self.mismatched[span.peer_id] = span
        return False
