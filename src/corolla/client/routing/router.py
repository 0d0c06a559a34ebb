"""Choosing the servers of a chain: which servers may serve a request, and the cheapest chain of them.

`routable` is the one filter: servers that answered this client's pings, not banned or avoided, allowed
(by the client's configuration and by the request), with the active adapter, with full-precision weights
when `exact`, and taking sessions of the request's length. Among them the cheapest chain is chosen under
what the client knows of each server (client/routing/estimates.py, swarm/policy/routing.py). With blocks
uncovered, the router waits up to `routing_timeout` for servers (re-reading the DHT), then raises
MissingBlocks naming the blocks and, in a private swarm, why servers refused this peer, and any undecided
dispute between servers of them (client/routing/bans.py), which it tries to settle while it waits.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Collection

from corolla.client.routing.bans import Bans
from corolla.client.routing.estimates import ServerEstimates
from corolla.client.routing.swarm_view import SwarmView
from corolla.config import ClientConfig
from corolla.errors import LengthLimit, MissingBlocks, counted
from corolla.swarm.dht import RemoteSpan
from corolla.swarm.policy.routing import Hop, chain_cost, choose_chain, format_blocks, uncovered_blocks

logger = logging.getLogger(__name__)

# seconds between looks at the swarm while blocks are uncovered: the first wait, doubling up to the longest
FIRST_WAIT = 0.2
LONGEST_WAIT = 2.0


class Router:
    def __init__(
        self,
        config: ClientConfig,
        num_blocks: int,
        view: SwarmView,
        bans: Bans,
        estimates: ServerEstimates,
        rng: random.Random | None = None,
        forbidden_cuts: frozenset[int] = frozenset(),
    ):
        self.config = config
        self.num_blocks = num_blocks
        self.forbidden_cuts = forbidden_cuts  # where no hop may start or end (models/kv_sharing.py)
        self._view = view
        self._bans = bans
        self._estimates = estimates
        self._rng = rng or random.Random()

    async def route(
        self,
        start: int = 0,
        end: int | None = None,
        *,
        needed_cache: int = 0,
        max_length: int = 0,
        avoid: Collection[str] = (),
        allowed: Collection[str] | None = None,
        wait: bool = True,
        shun: Collection[str] = (),
    ) -> list[Hop]:
        """A chain of servers over blocks [start, end): the cheapest of the routable ones (see `routable`),
        without the servers `shun` names where the others cover the blocks (`choose`). Waits up to
        routing_timeout for every block to be covered (`wait`; else MissingBlocks at once)."""
        end = self.num_blocks if end is None else end
        deadline = time.monotonic() + self.config.routing_timeout
        delay = FIRST_WAIT
        repinged = False
        while True:
            if self._view.stale:
                await self._view.refresh()
            try:
                return self.choose(start, end, needed_cache, max_length, avoid, allowed, shun)
            except MissingBlocks as e:
                # servers that missed their last ping may answer now (once: later rounds refresh)
                if not repinged:
                    repinged = True
                    if await self._view.ping_silent(avoid):
                        continue
                if not wait:
                    raise MissingBlocks(e.message + self._bans.explain(start, end), e.blocks) from None
                if self._bans.settle_disputes is not None and self._bans.undecided:
                    await self._bans.settle_disputes()  # a server that joined may settle one
                if time.monotonic() + delay > deadline:
                    self._raise_missing(e, start, end)
                logger.debug("Waiting for servers: %s", e.message)
            await asyncio.sleep(delay)
            delay = min(delay * 2, LONGEST_WAIT)
            await self._view.refresh()

    def choose(
        self,
        start: int,
        end: int,
        needed_cache: int = 0,
        max_length: int = 0,
        avoid: Collection[str] = (),
        allowed: Collection[str] | None = None,
        shun: Collection[str] = (),
    ) -> list[Hop]:
        """`route`'s decision without its waiting: the cheapest chain of the routable servers over
        [start, end) as the client knows them now; MissingBlocks at once if some block has none. `shun`:
        servers left out where the others cover the blocks (a replacement's neighbours in its chain: a
        chain does not go from a server to the same server again, a round trip and a pass for nothing)."""
        if shun:
            try:
                return self.choose(start, end, needed_cache, max_length, {*avoid, *shun}, allowed)
            except (MissingBlocks, LengthLimit):
                pass
        return self._cheapest(self.routable(start, end, max_length, avoid, allowed), start, end, needed_cache)

    def routable(
        self,
        start: int,
        end: int,
        max_length: int = 0,
        avoid: Collection[str] = (),
        allowed: Collection[str] | None = None,
    ) -> list[RemoteSpan]:
        """The servers a chain over [start, end) may use. InvalidRequest if the blocks are served, but only
        by servers with a lower inference_max_length than `max_length` (no server would take the request:
        refused before sending)."""
        config = self.config
        excluded = self._bans.banned() | set(avoid)
        limits = [set(a) for a in (config.allowed_servers, allowed) if a is not None]
        served = [
            span
            for span in self._view.spans
            if span.peer_id in self._view.answered
            and span.peer_id not in excluded
            and all(span.peer_id in limit for limit in limits)
            and (config.active_adapter is None or config.active_adapter in span.info.adapters)
            and not (config.exact and span.info.quantized)
        ]
        usable = [span for span in served if span.info.inference_max_length >= max_length]
        short = uncovered_blocks(usable, start, end)
        if short and not uncovered_blocks(served, start, end):
            limit = max(s.info.inference_max_length for s in served if s.start <= short[0] < s.end)
            raise LengthLimit(
                f"max_length={max_length} exceeds the inference_max_length of every server for blocks "
                f"{format_blocks(short)} (at most {limit})",
                limit,
            )
        return usable

    def step_cost(self, hops: list[Hop], needed_cache: int = 0, idle: Collection[Hop] = ()) -> float:
        """A given chain's expected decode-step time (swarm/policy/routing.py `chain_cost`), from what is
        known; `idle`: hops of this client's own sessions that run in no pass (one kept for its prefix),
        not counted as load on their servers."""
        peers = {hop.peer_id for hop in hops}
        spans = [span for span in self._view.spans if span.peer_id in peers]
        links = {s.peer_id: dict(s.info.next_pings) for s in spans}
        self._estimates.release(idle)
        try:
            estimates = self._estimates.estimates(spans, self._view.spans)
        finally:
            self._estimates.acquire(idle)
        return chain_cost(hops, estimates, links, self.config.use_push, needed_cache)

    def _cheapest(self, spans: list[RemoteSpan], start: int, end: int, needed_cache: int) -> list[Hop]:
        return choose_chain(
            spans,
            start,
            end,
            estimates=self._estimates.estimates(spans, self._view.spans),
            links={s.peer_id: dict(s.info.next_pings) for s in spans},
            push=self.config.use_push,
            needed_cache=needed_cache,
            rng=self._rng,
            forbidden_cuts=self.forbidden_cuts,
        )

    def _raise_missing(self, error: MissingBlocks, start: int, end: int) -> None:
        config = self.config
        refusals = self._view.refusals
        which = f" with adapter {config.active_adapter!r}" if config.active_adapter is not None else ""
        which += " with full-precision weights (exact)" if config.exact else ""
        refused = f"; {counted(len(refusals), 'server')} refused this peer: " if refusals else ""
        refused += next(iter(refusals.values()), "")
        disputes = self._bans.explain(start, end)
        full = self._bans.out_of_cache()
        busy = sum(s.peer_id in full and s.start < end and start < s.end for s in self._view.spans)
        busy_text = f"; {counted(busy, 'server')} of them had no cache left for this session" if busy else ""
        raise MissingBlocks(
            f"{error.message}; waited {config.routing_timeout:.0f}s for servers{which}{refused}{disputes}"
            f"{busy_text}",
            error.blocks,
        ) from None
