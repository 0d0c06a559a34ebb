"""A swarm peer serving a span of blocks: wires config, DHT, weights, handler and announcer together.

Start order: DHT first (its child process forks from a small parent), then the span's weights, then the
RPC handlers, then the ONLINE announcement, so a client never finds a server that cannot answer yet.
Stop order is the reverse, with an OFFLINE announcement first so clients stop routing here.

A server started without --blocks places itself (server/placement.py) and, every balance period, checks
whether moving would clearly help the swarm; a move loads and announces the new blocks first, lets the
sessions on the old blocks finish (up to the drain timeout), and only then unloads them.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from corolla import __version__
from corolla.config import ServerConfig
from corolla.engine.engine import EngineConfig, EngineStats
from corolla.errors import InvalidRequest
from corolla.models.config import ModelConfig, parse_dtype
from corolla.models.source import dht_prefix_for, resolve_model
from corolla.models.span import Span
from corolla.server.announcer import Announcer
from corolla.server.backend import SpanBackend
from corolla.server.handler import TransformerConnectionHandler
from corolla.server.metrics import ServerMetrics
from corolla.server.placement import blocks_for_budget, choose_blocks, my_move
from corolla.server.push import Pusher
from corolla.server.throughput import measure_throughput
from corolla.swarm.dht import find_spans, start_dht
from corolla.swarm.ping import ping
from corolla.wire.records import ServerAnnouncement, ServerState

logger = logging.getLogger(__name__)

BUDGET_CACHE_TOKENS = 4096  # attention cache set aside per block when a memory budget sizes the span
MAX_LINKS = 8  # next servers pinged for push-aware routing


class Server:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.dht = None
        self.p2p = None
        self.backends: list[SpanBackend] = []
        self.handler: TransformerConnectionHandler | None = None
        self.throughput: float | None = None
        self.announcer: Announcer | None = None
        self._balancer: asyncio.Task | None = None
        self._linker: asyncio.Task | None = None
        self.next_pings: dict[str, float] = {}  # round trips to servers that can take our outputs (push)
        self._retiring: set[asyncio.Task] = set()
        self.metrics: ServerMetrics | None = None
        self.adapters = adapter_names(config.adapters)  # (name, folder) pairs
        if config.metrics_port is not None:
            self.metrics = ServerMetrics(self._live_figures)

    async def start(self) -> None:
        config = self.config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        source = resolve_model(config.model)
        self.folder, self.model = source.path, ModelConfig.from_folder(source.path)
        self.dtype = parse_dtype(config.dtype, self.model)
        self.dht_prefix = config.dht_prefix or dht_prefix_for(source.name)
        self.dht = start_dht(config.swarm)
        self.peer_id = str(self.dht.peer_id)
        # measured on one block before choosing blocks: placement weighs the swarm by throughput
        probe = await asyncio.to_thread(Span.load, self.folder, 0, 1, self.dtype)
        self.throughput = await asyncio.to_thread(measure_throughput, probe)
        del probe
        blocks = await self._choose_blocks()
        logger.info("Loading blocks %d:%d of %s (%s)", *blocks, self.folder, self.dtype)
        self.backends.append(await self._backend(blocks))
        self.handler = TransformerConnectionHandler(self.backends, config, self.dht_prefix, __version__)
        self.handler.adapters = frozenset(name for name, _ in self.adapters)
        self.p2p = await self.dht.replicate_p2p()
        self.handler.pusher = Pusher(self.p2p, self.dht_prefix)
        if self.metrics is not None:
            self.metrics.serve(config.metrics_host, config.metrics_port)
        await self.handler.add_p2p_handlers(self.p2p)
        self.announcer = Announcer(
            self.dht,
            self.dht_prefix,
            self.peer_id,
            config.announce_period,
            self._record,
            self.model.num_hidden_layers,
        )
        await self.announcer.announce(ServerState.ONLINE)
        self.announcer.start()
        if config.blocks is None and config.balance_period > 0:
            self._balancer = asyncio.create_task(self._balance_forever(), name="corolla-balancer")
        self._linker = asyncio.create_task(self._measure_links_forever(), name="corolla-links")
        logger.info("Serving blocks %d:%d of %s as %s", *blocks, self.dht_prefix, self.peer_id)

    async def _backend(self, blocks: tuple[int, int]) -> SpanBackend:
        config = self.config
        cache_tokens = config.max_cache_tokens or (
            BUDGET_CACHE_TOKENS
            if config.memory_budget
            else default_cache_tokens(self.model, blocks[1] - blocks[0], self.dtype)
        )
        engine_config = EngineConfig(
            max_cache_tokens=cache_tokens,
            block_size=config.block_size,
            max_batch_tokens=config.max_batch_tokens,
            max_batch_rows=config.max_batch_rows,
            max_batch_wait=config.max_batch_wait_ms / 1000,
            forward_slice_tokens=config.forward_slice_tokens,
            max_sessions=config.max_sessions,
        )
        logger.info(
            "Engine: %d cache tokens in blocks of %d, %d tokens and %d rows per pass",
            cache_tokens,
            engine_config.block_size,
            engine_config.max_batch_tokens,
            engine_config.max_batch_rows,
        )
        backend = await SpanBackend.create(
            Path(self.folder),
            blocks,
            self.dtype,
            engine_config,
            config.session_timeout,
            config.simulate_slow_ms / 1000,
            self.adapters,
        )
        if self.metrics is not None:
            backend.engine.pass_listeners.append(self.metrics.observe_pass)
        return backend

    async def _choose_blocks(self) -> tuple[int, int]:
        total = self.model.num_hidden_layers
        if self.config.blocks is not None:
            start, end = self.config.blocks
            if not 0 <= start < end <= total:
                raise InvalidRequest(
                    f"--blocks {start}:{end} is not a range inside the model's {total} blocks"
                )
            return start, end
        num_blocks = self.config.num_blocks or self._blocks_in_budget()
        if num_blocks < 1:
            raise InvalidRequest("the memory budget does not hold a single block (see --memory-budget)")
        others = await self._placed()
        others.pop(self.peer_id, None)
        return choose_blocks(others.values(), min(num_blocks, total), total, self.throughput or 1.0)

    def _blocks_in_budget(self) -> int:
        budget = self.config.memory_budget or int(psutil.virtual_memory().available * 0.5)
        cache = self.config.max_cache_tokens or BUDGET_CACHE_TOKENS
        num_blocks = blocks_for_budget(self.model, self.dtype.itemsize, budget, cache)
        logger.info(
            "A memory budget of %.0f MB holds %d blocks (with %d cache tokens)",
            budget / 2**20,
            num_blocks,
            cache,
        )
        return num_blocks

    async def _placed(self) -> dict[str, tuple[int, int, float]]:
        """Every ONLINE server's span by peer id, weighted by its throughput (1.0 when it announced none)."""
        spans = await find_spans(self.dht, self.dht_prefix, self.model.num_hidden_layers)
        return {s.peer_id: (s.start, s.end, s.info.throughput or 1.0) for s in spans}

    # --- links to the next servers, for push-aware routing -------------------------------------------------

    async def _measure_links_forever(self) -> None:
        while True:
            try:
                end = self.backends[0].blocks[1]
                placed = await self._placed()
                placed.pop(self.peer_id, None)
                nexts = [peer for peer, (start, stop, _) in placed.items() if start <= end < stop][:MAX_LINKS]
                answers = await asyncio.gather(*(ping(self.p2p, peer, 2.0) for peer in nexts))
                pings = zip(nexts, answers, strict=True)
                self.next_pings = {peer: answer[0] for peer, answer in pings if answer is not None}
            except Exception:  # a DHT hiccup: keep the last figures
                logger.debug("Measuring the links to the next servers failed", exc_info=True)
            await asyncio.sleep(self.config.announce_period)

    # --- rebalancing ---------------------------------------------------------------------------------------

    async def _balance_forever(self) -> None:
        while True:
            # servers decide from the same view which one of them moves (placement.my_move); the jitter
            # spreads their DHT reads
            await asyncio.sleep(self.config.balance_period * random.uniform(0.8, 1.2))
            try:
                if len(self.backends) == 1 and not self.handler.draining:
                    servers = await self._placed()
                    servers[self.peer_id] = (*self.backends[0].blocks, self.throughput or 1.0)
                    target = my_move(servers, self.peer_id, self.model.num_hidden_layers)
                    if target is not None:
                        await self._move_to(target)
            except Exception:  # a failed check or move is retried at the next period
                logger.warning("Rebalancing failed", exc_info=True)

    async def _move_to(self, blocks: tuple[int, int]) -> None:
        """Serve `blocks` instead: new blocks first, the old ones retire once their sessions end."""
        old = self.backends[0]
        logger.info("Moving from blocks %d:%d to %d:%d to balance the swarm", *old.blocks, *blocks)
        new = await self._backend(blocks)
        old.accepting = False
        self.backends.insert(0, new)
        self.announcer.leaving = range(*old.blocks)  # our records there now point clients elsewhere
        await self.announcer.announce(ServerState.ONLINE)
        task = asyncio.create_task(self._retire(old))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, old: SpanBackend) -> None:
        deadline = asyncio.get_running_loop().time() + self.config.drain_timeout
        if len(old.sessions):
            logger.info(
                "Blocks %d:%d retire once their %d sessions end (at most %.0fs)",
                *old.blocks,
                len(old.sessions),
                self.config.drain_timeout,
            )
        while len(old.sessions) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.5)
        if len(old.sessions):
            logger.warning(
                "%d sessions on blocks %d:%d outlived the move's drain timeout; they will fail over",
                len(old.sessions),
                *old.blocks,
            )
        self.backends.remove(old)
        await old.stop()
        logger.info("Unloaded blocks %d:%d", *old.blocks)

    # --- announcements and shutdown ------------------------------------------------------------------------

    def _record(self, state: ServerState) -> ServerAnnouncement:
        info = self.handler.info()
        return ServerAnnouncement(
            state=state,
            start=info.start,
            end=info.end,
            version=info.version,
            dtype=info.dtype,
            inference_max_length=info.inference_max_length,
            cache_tokens_available=info.cache_tokens_available,
            num_sessions=info.num_sessions,
            queued_tokens=info.queued_tokens,
            throughput=self.throughput,
            next_pings=tuple(self.next_pings.items()),
            adapters=tuple(name for name, _ in self.adapters),
        )

    async def drain(self, timeout: float, hurry: asyncio.Event) -> None:
        """Stop taking new sessions and wait (up to `timeout`, or until `hurry`) for the open ones to end.

        OFFLINE is announced first, so clients route new sessions elsewhere; a client that still opens a
        session here gets ServerUnavailable and fails over.
        """
        if self.handler is None:
            return
        self.handler.draining = True
        if self.announcer is not None:
            await self.announcer.stop()
            await asyncio.wait_for(self.announcer.announce(ServerState.OFFLINE), timeout=5)
        deadline = asyncio.get_running_loop().time() + timeout
        while self.handler.num_sessions and not hurry.is_set():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                logger.warning("Drain timeout: closing %d sessions", self.handler.num_sessions)
                return
            logger.info(
                "Draining: waiting for %d sessions (at most %.0fs more)", self.handler.num_sessions, left
            )
            try:
                await asyncio.wait_for(hurry.wait(), min(left, 1.0))
            except (asyncio.TimeoutError, TimeoutError):
                pass

    async def stop(self) -> None:
        for task in [self._balancer, self._linker, *self._retiring]:
            if task is not None:
                task.cancel()
        if self.announcer is not None:
            await self.announcer.stop()
            try:
                await asyncio.wait_for(self.announcer.announce(ServerState.OFFLINE), timeout=5)
            except Exception:  # the DHT may already be unreachable; records then expire on their own
                logger.warning("Could not announce OFFLINE", exc_info=True)
        if self.handler is not None and self.handler.pusher is not None:
            await self.handler.pusher.close()
        for backend in self.backends:
            await backend.stop()
            stats = backend.engine.stats
            logger.info(
                "Engine ran %d passes, %.1f rows per pass on average",
                stats.num_passes,
                stats.total_rows / max(stats.num_passes, 1),
            )
        if self.metrics is not None:
            self.metrics.stop()
        if self.p2p is not None:
            await self.p2p.shutdown()
        if self.dht is not None:
            self.dht.shutdown()
        logger.info("Server stopped")

    def _live_figures(self) -> tuple[list[EngineStats], int]:
        """For metrics scrapes (another thread): the engines' last snapshots and the open sessions."""
        sessions = self.handler.num_sessions if self.handler is not None else 0
        return [backend.engine.stats for backend in list(self.backends)], sessions


def adapter_names(specs: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """`NAME=PATH` or `PATH` (named after its folder) -> (name, path) pairs, names unique."""
    pairs = []
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        pairs.append((name or Path(path).name, path))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise InvalidRequest(f"--adapters: two adapters share a name among {names}")
    return tuple(pairs)


def default_cache_tokens(model: ModelConfig, num_blocks: int, dtype: torch.dtype) -> int:
    """A quarter of the memory available now, in tokens of cache (with the inputs kept per token).

    The pool is allocated lazily (pages are touched as blocks are first written), so a large default
    costs memory only when sessions use it. Capped at 2**18 tokens, and at least 1024.
    """
    per_token = model.kv_bytes_per_token_per_block(dtype.itemsize) * num_blocks + model.hidden_size * 4
    tokens = int(psutil.virtual_memory().available * 0.25) // per_token
    return max(1024, min(tokens, 2**18))


async def serve(config: ServerConfig, on_ready: Callable[[Server], None] | None = None) -> None:
    """Run a server until SIGINT or SIGTERM, drain its sessions, then shut it down.

    A second signal during the drain stops at once.
    """
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    server = Server(config)
    try:
        await server.start()
        if on_ready is not None:
            on_ready(server)
        await stop.wait()
        logger.info(
            "Shutting down (signal received): no new sessions, draining open ones for up to %.0fs",
            config.drain_timeout,
        )
        try:
            await server.drain(config.drain_timeout, hurry)
        except Exception:  # a failed OFFLINE announcement must not keep the server up
            logger.warning("Drain failed; stopping now", exc_info=True)
    finally:
        await server.stop()
