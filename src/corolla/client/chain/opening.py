"""The links of a chain (client/chain/chain.py): a stream to each hop's server and what its cache was built
from, and how a run of them opens over blocks [start, end), or on the servers of another chain, each session
forked from that chain's (reused prefixes: client/generation/prefixes.py).

Opening routes the blocks (client/routing/router.py), counts the hops' load at once (so that sessions opened
together spread out), opens a session on every hop in parallel with the encodings each server takes,
and routes again around servers that fail to open (banning them), a few times at most.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from corolla.client.chain.hop_history import HopHistory
from corolla.client.routing.bans import Bans
from corolla.client.routing.swarm_access import SwarmAccess
from corolla.client.rpc.peers import hop_encodings
from corolla.client.rpc.span_stream import Opening, SpanStream
from corolla.config import ClientConfig
from corolla.errors import RETRYABLE, ServerUnavailable
from corolla.swarm.policy.routing import Hop


@dataclass
class Link:
    """One hop of a chain: the stream to its server and what that server's cache was built from."""

    stream: SpanStream
    history: HopHistory

    @property
    def hop(self) -> Hop:
        return self.stream.hop


@dataclass(frozen=True)
class ChainSpec:
    """What every server of a chain must take, and which servers it may use."""

    max_length: int
    alloc_timeout: float = 0.0
    keep_outputs: bool = False  # each hop's replies too (spot checks compare them)
    avoid: frozenset[str] = frozenset()  # never these servers (a shadow avoids the server it checks)
    allowed: frozenset[str] | None = None  # only these servers (a session's own restriction)
    wait: bool = True  # wait for servers when blocks are uncovered (else MissingBlocks at once)
    keep: bool = False  # servers keep the sessions for later forks when they end (reused prefixes)


async def open_links(
    swarm: SwarmAccess, spec: ChainSpec, start: int, end: int, shun: Collection[str] = ()
) -> list[Link]:
    """Streams to a chain of servers over blocks [start, end), re-routing around servers that fail to
    open (`shun`: servers used only where nothing else serves, Router.choose)."""
    for _ in range(opening_tries(swarm.config)):
        hops = await swarm.router.route(
            start,
            end,
            needed_cache=spec.max_length,
            max_length=spec.max_length,
            avoid=spec.avoid,
            allowed=spec.allowed,
            wait=spec.wait,
            shun=shun,
        )
        swarm.estimates.acquire(hops)  # counted at once, so that concurrent sessions spread out
        results = await asyncio.gather(*_openings(swarm, spec, hops), return_exceptions=True)
        failed = [(hop, r) for hop, r in zip(hops, results, strict=True) if isinstance(r, BaseException)]
        if not failed:
            return [Link(stream, HopHistory(spec.keep_outputs)) for stream in results]
        swarm.estimates.release(hops)
        opened = [r for r in results if isinstance(r, SpanStream)]
        await asyncio.gather(*(stream.close() for stream in opened), return_exceptions=True)
        pass_over(swarm.bans, failed)
    raise out_of_tries(swarm.config, start, end)


def opening_tries(config: ClientConfig) -> int:
    """Chains routed for one opening at most: the first and max_retries more."""
    return config.max_retries + 1


def pass_over(bans: Bans, failed: Iterable[tuple[Hop, BaseException]]) -> None:
    """Servers that failed to open a session are passed over for a while (`Bans.failed`: one without
    cache for it only briefly) before routing again; an error that no other chain can help is raised."""
    for hop, error in failed:
        if not isinstance(error, RETRYABLE):
            raise error
        bans.failed(hop.peer_id, error)


def out_of_tries(config: ClientConfig, start: int, end: int) -> ServerUnavailable:
    return ServerUnavailable(
        f"could not open sessions for blocks {start}:{end} after {opening_tries(config)} tries"
    )


async def fork_links(
    swarm: SwarmAccess, spec: ChainSpec, sources: list[Link], position: int, batch: int
) -> list[Link]:
    """Streams to the servers of `sources`, each session to start from its source's state at `position`
    (with `batch` rows: the source's, or its one row repeated), and histories copied up to there.
    ServerUnavailable if a server may not be used now (the caller opens a chain the usual way)."""
    hops = [link.hop for link in sources]
    for hop in hops:
        usable = swarm.router.routable(hop.start, hop.end, spec.max_length, spec.avoid, spec.allowed)
        if not any(
            span.peer_id == hop.peer_id and span.start <= hop.start and hop.end <= span.end for span in usable
        ):
            raise ServerUnavailable(f"server ...{hop.peer_id[-6:]} holding the prefix is not routable now")
    swarm.estimates.acquire(hops)
    forks = [link.stream.session_id for link in sources]
    results = await asyncio.gather(*_openings(swarm, spec, hops, forks), return_exceptions=True)
    if any(isinstance(r, BaseException) for r in results):
        swarm.estimates.release(hops)
        opened = [r for r in results if isinstance(r, SpanStream)]
        await asyncio.gather(*(stream.close() for stream in opened), return_exceptions=True)
        raise ServerUnavailable(f"could not open forks on the servers holding the prefix: {results}")
    return [
        Link(stream, source.history.fork(position, batch))
        for stream, source in zip(results, sources, strict=True)
    ]


def _openings(swarm: SwarmAccess, spec: ChainSpec, hops: list[Hop], forks: list[str] | None = None) -> list:
    statuses = [swarm.view.status_of(hop.peer_id) for hop in hops]
    openings = []
    encodings = hop_encodings(swarm.config.wire_encoding, statuses)
    for i, (hop, (inbound, outbound)) in enumerate(zip(hops, encodings, strict=True)):
        fork_of = None if forks is None else forks[i]
        adapter = swarm.config.active_adapter
        opening = Opening(spec.max_length, spec.alloc_timeout, adapter, outbound, fork_of, spec.keep)
        openings.append(swarm.peers.open_session(hop, opening, inbound))
    return openings
