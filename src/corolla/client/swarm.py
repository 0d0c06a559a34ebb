"""The client's view of the swarm: its DHT peer, the servers it has seen, and chains through them.

A background task re-reads the DHT and pings every server (rpc_info: round-trip time and live load)
every `refresh_period`. Only servers that answered a ping are routed to: a record alone (any peer can
sign one for itself) never makes a server. Routing picks the cheapest chain under those estimates
(client/estimates.py, swarm/routing.py), avoiding banned servers; it waits up to `routing_timeout` for
the blocks it needs to be covered, then raises `MissingBlocks` naming the uncovered blocks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from hivemind import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError, P2PHandlerError

from corolla.client.estimates import ServerEstimates
from corolla.config import ClientConfig
from corolla.errors import (
    CacheExhausted,
    InvalidRequest,
    MissingBlocks,
    RemoteError,
    ServerUnavailable,
    SessionTimeout,
    counted,
    decode_remote_error,
)
from corolla.swarm.dht import RemoteSpan, find_spans, start_dht
from corolla.swarm.ping import fetch_status, ping
from corolla.swarm.reports import report_faulty
from corolla.swarm.routing import Hop, choose_chain, format_blocks, uncovered_blocks
from corolla.wire.records import ServerStatus

if TYPE_CHECKING:
    from corolla.client.spot_checks import SpotChecker

logger = logging.getLogger(__name__)

PING_TIMEOUT = 2.0
# errors another server may not repeat. InvalidRequest and MissingBlocks raised here are final (a server's
# InvalidRequest for a request the client checked is its own fault: see remote_errors)
RETRYABLE = (ServerUnavailable, SessionTimeout, CacheExhausted, RemoteError)


class SwarmClient:
    def __init__(self, config: ClientConfig, dht_prefix: str, num_blocks: int, model_fingerprint: str = ""):
        """`model_fingerprint` (ModelConfig.fingerprint()): servers that announce another one serve another
        model under the same prefix; they are left out of `spans` and listed in `mismatched`."""
        self.config, self.dht_prefix, self.num_blocks = config, dht_prefix, num_blocks
        self.model_fingerprint = model_fingerprint
        self.mismatched: dict[str, RemoteSpan] = {}  # peer id -> the last record of such a server
        self.dht: DHT | None = None
        self.p2p: P2P | None = None
        self.spans: list[RemoteSpan] = []
        self.estimates = ServerEstimates()
        self.answered: set[str] = set()  # servers that answered rpc_info: the only ones routed to
        self.refusals: dict[str, str] = {}  # servers of a private swarm that refuse this peer: why
        self.faulty: dict[str, str] = {}  # servers caught computing wrong outputs (banned for good): what
        self.spot_checker: SpotChecker | None = None  # set by the model when config.spot_checks > 0
        self.rejected_records: Counter[str] = Counter()  # unsigned or malformed records read, by reason
        self._bans: dict[str, tuple[float, int]] = {}  # peer id -> (banned until, failures so far)
        self._refreshed_at, self._rng = 0.0, random.Random()
        self._refresher: asyncio.Task | None = None
        self._refreshing: asyncio.Future | None = None  # the refresh in progress, shared by its callers
        self._reporting: asyncio.Future | None = None  # this client's report of faulty servers, being stored

    async def start(self) -> None:
        self.dht = await asyncio.to_thread(start_dht, self.config.swarm)
        self.p2p = await self.dht.replicate_p2p()
        self._refresher = asyncio.create_task(self._refresh_forever(), name="corolla-swarm-refresh")

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_period)
            try:
                await self.refresh()
            except Exception:  # a DHT hiccup; the next round tries again
                logger.debug("Background refresh failed", exc_info=True)

    async def shutdown(self) -> None:
        for task in (self._refresher, self._refreshing, self._reporting):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self.p2p is not None:
            await self.p2p.shutdown()  # a replica: closes our connection to the daemon, not the daemon
            self.p2p = None
        if self.dht is not None:
            await asyncio.to_thread(self.dht.shutdown)
            self.dht = None

    async def refresh(self) -> list[RemoteSpan]:
        """Re-read the DHT and ping every server found (round-trip time, live load).

        Concurrent callers (a burst of new sessions) share one refresh: parallel rounds of pings would
        queue behind each other and inflate the very round trips they measure.
        """
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._refresh())
        return await asyncio.shield(self._refreshing)

    async def _refresh(self) -> list[RemoteSpan]:
        spans = await find_spans(self.dht, self.dht_prefix, self.num_blocks, tally=self.rejected_records)
        self.spans = [s for s in spans if self._same_model(s)]
        self._refreshed_at = time.monotonic()
        banned = self.banned()
        await asyncio.gather(*(self._ping(s.peer_id) for s in self.spans if s.peer_id not in banned))
        return self.spans

    def _long_enough(
        self, spans: list[RemoteSpan], start: int, end: int, max_length: int
    ) -> list[RemoteSpan]:
        """The spans that take sessions of `max_length` tokens; InvalidRequest if the blocks are served,
        but only by servers with a lower limit (a request no server would take: refused before sending)."""
        banned, allowed = self.banned(), self.config.allowed_servers
        served = [s for s in spans if s.peer_id not in banned and (allowed is None or s.peer_id in allowed)]
        usable = [s for s in spans if s.info.inference_max_length >= max_length]
        short = uncovered_blocks([s for s in served if s.info.inference_max_length >= max_length], start, end)
        if short and not uncovered_blocks(served, start, end):
            limit = max(s.info.inference_max_length for s in served if s.start <= short[0] < s.end)
            raise InvalidRequest(
                f"max_length={max_length} exceeds the inference_max_length of every server for blocks "
                f"{format_blocks(short)} (at most {limit})"
            )
        return usable

    def _same_model(self, span: RemoteSpan) -> bool:
        if span.info.serves_model(self.model_fingerprint):
            return True
        if span.peer_id not in self.mismatched:
            logger.warning(
                "Ignoring server ...%s: it announces blocks %d:%d of %s for another model (fingerprint %s, "
                "this model's is %s)",
                span.peer_id[-6:],
                span.start,
                span.end,
                self.dht_prefix,
                span.info.model_fingerprint,
                self.model_fingerprint,
            )
        self.mismatched[span.peer_id] = span
        return False

    async def _ping(self, peer_id: str) -> None:
        # a server met for the first time gets a few pings: one round trip alone is noise
        for _ in range(1 if self.estimates.has_rtt(peer_id) else 3):
            answer = await ping(self.p2p, peer_id, PING_TIMEOUT, self.refusals)
            if answer is None:
                return  # unreachable now: its steps will fail over if it is used anyway
            self.estimates.ping(peer_id, *answer)
            self.answered.add(peer_id)

    async def _ping_silent(self, avoid: Collection[str]) -> bool:
        """Ping again the servers that have not answered yet; whether any of them answered now."""
        skip = self.banned() | set(avoid) | self.answered
        silent = {s.peer_id for s in self.spans if s.peer_id not in skip}
        await asyncio.gather(*(self._ping(peer_id) for peer_id in silent))
        return bool(silent & self.answered)

    async def route(  # noqa: PLR0913
        self,
        start: int = 0,
        end: int | None = None,
        needed_cache: int = 0,
        max_length: int = 0,
        avoid: Collection[str] = (),
        wait: bool = True,
    ) -> list[Hop]:
        """A chain of servers over blocks [start, end), waiting up to routing_timeout for full coverage
        (`wait`; else MissingBlocks at once); only servers whose inference_max_length allows `max_length`
        (an inference session's) count, and none in `avoid`."""
        end = self.num_blocks if end is None else end
        deadline = time.monotonic() + self.config.routing_timeout
        delay, repinged = 0.2, False
        while True:
            if time.monotonic() - self._refreshed_at > self.config.refresh_period or not self.spans:
                await self.refresh()
            try:
                return choose_chain(
                    self._routable(start, end, max_length),
                    start,
                    end,
                    estimates=self.estimates.estimates(self.spans),
                    links={s.peer_id: dict(s.info.next_pings) for s in self.spans},
                    push=self.config.use_push,
                    needed_cache=needed_cache,
                    rng=self._rng,
                    allowed=self.config.allowed_servers,
                    banned=self.banned() | set(avoid),
                )
            except MissingBlocks as e:
                # servers that missed their last ping may answer now (once: later rounds refresh)
                if not repinged and (repinged := True) and await self._ping_silent(avoid):
                    continue
                if not wait:
                    raise
                if time.monotonic() + delay > deadline:
                    self._raise_missing(e)
                logger.debug("Waiting for servers: %s", e.message)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            await self.refresh()

    def _routable(self, start: int, end: int, max_length: int) -> list[RemoteSpan]:
        """Servers that answered, with the active adapter (full precision if exact), long enough."""
        adapter, exact = self.config.active_adapter, self.config.exact
        spans = [
            s
            for s in self.spans
            if s.peer_id in self.answered
            and (adapter is None or adapter in s.info.adapters)
            and not (exact and s.info.quantized)
        ]
        return self._long_enough(spans, start, end, max_length)

    def _raise_missing(self, error: MissingBlocks) -> None:
        adapter = self.config.active_adapter
        with_adapter = f" with adapter {adapter!r}" if adapter is not None else ""
        with_adapter += " with full-precision weights (exact)" if self.config.exact else ""
        refused = f"; {counted(len(self.refusals), 'server')} refused this peer: " if self.refusals else ""
        refused += next(iter(self.refusals.values()), "")
        raise MissingBlocks(
            f"{error.message}; waited {self.config.routing_timeout:.0f}s for servers{with_adapter}{refused}",
            error.blocks,
        ) from None

    def status_of(self, peer_id: str) -> ServerStatus | None:
        """A server's record as last read from the DHT (None: not seen)."""
        return next((s.info for s in self.spans if s.peer_id == peer_id), None)

    def ban(self, peer_id: str) -> None:
        """Avoid a server that failed: for ban_time, doubling with each failure in a row (at most 16x)."""
        _, failures = self._bans.get(peer_id, (0.0, 0))
        duration = self.config.ban_time * 2 ** min(failures, 4)
        self._bans[peer_id] = (time.monotonic() + duration, failures + 1)
        logger.info("Avoiding server ...%s for %.0fs after a failure", peer_id[-6:], duration)

    def ban_for_good(self, peer_id: str, reason: str) -> None:
        """Never use a server again (this client caught it computing wrong outputs)."""
        logger.warning("Server ...%s is faulty and banned for good: %s", peer_id[-6:], reason)
        self.faulty[peer_id] = reason
        if self.dht is not None:  # told to the swarm's operators (swarm/reports.py), in the background
            self._reporting = asyncio.ensure_future(
                report_faulty(self.dht, self.dht_prefix, dict(self.faulty))
            )

    def findings(self) -> dict:
        """What this client found of servers: caught lying (banned for good), its spot checks' counts."""
        checks = None if self.spot_checker is None else dict(self.spot_checker.counts)
        return {"faulty_servers": dict(self.faulty), "spot_checks": checks}

    async def release_checks(self, spans: list) -> None:
        """The spot checks' shadows of these span sessions are no longer needed (client/shadows.py)."""
        if self.spot_checker is not None:
            await self.spot_checker.release(spans)

    def banned(self) -> set[str]:
        now = time.monotonic()
        banned = {p for p, (until, _) in self._bans.items() if until > now}
        return set(self.config.blocked_servers) | set(self.faulty) | banned

    async def server_info(self, peer_id: str) -> ServerStatus:
        """A server's own report (rpc_info): its span, limits and live load."""
        timeout = self.config.request_timeout
        async with remote_errors(peer_id, timeout):
            return await fetch_status(self.p2p, peer_id, timeout)


def peer(peer_id: str) -> PeerID:
    return PeerID.from_base58(peer_id)


@asynccontextmanager
async def remote_errors(peer_id: str, timeout: float) -> AsyncIterator[None]:
    """Turn what hivemind raises for a failed call into corolla's typed errors."""
    short = peer_id[-6:]
    try:
        yield
    except P2PHandlerError as e:
        error = decode_remote_error(str(e))
        if isinstance(error, InvalidRequest):  # the client checked what it sent: this server is at fault
            raise ServerUnavailable(
                f"server ...{short} refused a well-formed request: {error.message}"
            ) from None
        raise decode_remote_error(str(e), f"...{short}") from None
    except (asyncio.TimeoutError, TimeoutError):
        raise ServerUnavailable(f"server ...{short} did not reply within {timeout:.1f}s") from None
    except (P2PDaemonError, ConnectionError, OSError, asyncio.IncompleteReadError, StopAsyncIteration) as e:
        raise ServerUnavailable(
            f"server ...{short} is unreachable or closed the stream ({type(e).__name__}: {e})"
        ) from None
