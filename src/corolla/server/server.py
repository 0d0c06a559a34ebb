"""A swarm peer serving a span of blocks: wires config, DHT, weights, handler and announcer together.

Start order: DHT first (its child process forks from a small parent), then the span's weights, then the
RPC handlers, then the ONLINE announcement, so a client never finds a server that cannot answer yet.
Stop order is the reverse, with an OFFLINE announcement first so clients stop routing here.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import psutil
import torch

from corolla import __version__
from corolla.config import ServerConfig
from corolla.engine.async_engine import AsyncEngine
from corolla.engine.engine import Engine, EngineConfig
from corolla.errors import InvalidRequest
from corolla.models.config import ModelConfig, parse_dtype
from corolla.models.source import dht_prefix_for, resolve_model
from corolla.models.span import Span
from corolla.server.announcer import Announcer
from corolla.server.handler import TransformerConnectionHandler
from corolla.server.placement import choose_blocks
from corolla.server.push import Pusher
from corolla.server.throughput import measure_throughput
from corolla.swarm.dht import find_spans, start_dht
from corolla.wire.records import ServerAnnouncement, ServerState

logger = logging.getLogger(__name__)


class Server:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.dht = None
        self.p2p = None
        self.handler: TransformerConnectionHandler | None = None
        self.engine: AsyncEngine | None = None
        self.throughput: float | None = None
        self.announcer: Announcer | None = None

    async def start(self) -> None:
        config = self.config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        source = resolve_model(config.model)
        model = ModelConfig.from_folder(source.path)
        dtype = parse_dtype(config.dtype, model)
        self.dht_prefix = config.dht_prefix or dht_prefix_for(source.name)
        self.dht = start_dht(config.swarm)
        self.peer_id = str(self.dht.peer_id)
        start, end = await self._choose_blocks(model)
        logger.info("Loading blocks %d:%d of %s (%s)", start, end, source.path, dtype)
        span = await asyncio.to_thread(Span.load, source.path, start, end, dtype)
        engine_config = EngineConfig(
            max_cache_tokens=config.max_cache_tokens or default_cache_tokens(model, end - start, dtype),
            block_size=config.block_size,
            max_batch_tokens=config.max_batch_tokens,
            max_batch_rows=config.max_batch_rows,
            max_batch_wait=config.max_batch_wait_ms / 1000,
            max_sessions=config.max_sessions,
        )
        self.throughput = await asyncio.to_thread(measure_throughput, span)
        self.engine = AsyncEngine(Engine(span, engine_config), pass_delay=config.simulate_slow_ms / 1000)
        self.engine.start()
        logger.info(
            "Engine: %d cache tokens in blocks of %d, %d tokens and %d rows per pass",
            engine_config.max_cache_tokens,
            engine_config.block_size,
            engine_config.max_batch_tokens,
            engine_config.max_batch_rows,
        )
        self.handler = TransformerConnectionHandler(span, config, self.dht_prefix, self.engine, __version__)
        self.p2p = await self.dht.replicate_p2p()
        self.handler.pusher = Pusher(self.p2p, self.dht_prefix)
        await self.handler.add_p2p_handlers(self.p2p)
        self.announcer = Announcer(
            self.dht, self.dht_prefix, self.peer_id, config.announce_period, self._record
        )
        await self.announcer.announce(ServerState.ONLINE)
        self.announcer.start()
        logger.info("Serving blocks %d:%d of %s as %s", start, end, self.dht_prefix, self.peer_id)

    async def _choose_blocks(self, model: ModelConfig) -> tuple[int, int]:
        total = model.num_hidden_layers
        if self.config.blocks is not None:
            start, end = self.config.blocks
            if not 0 <= start < end <= total:
                raise InvalidRequest(
                    f"--blocks {start}:{end} is not a range inside the model's {total} blocks"
                )
            return start, end
        num_blocks = min(self.config.num_blocks or total, total)
        spans = await find_spans(self.dht, self.dht_prefix, total)
        return choose_blocks([(s.start, s.end) for s in spans], num_blocks, total)

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
        while len(self.handler.sessions) and not hurry.is_set():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                logger.warning("Drain timeout: closing %d sessions", len(self.handler.sessions))
                return
            logger.info(
                "Draining: waiting for %d sessions (at most %.0fs more)", len(self.handler.sessions), left
            )
            try:
                await asyncio.wait_for(hurry.wait(), min(left, 1.0))
            except (asyncio.TimeoutError, TimeoutError):
                pass

    async def stop(self) -> None:
        if self.announcer is not None:
            await self.announcer.stop()
            try:
                await asyncio.wait_for(self.announcer.announce(ServerState.OFFLINE), timeout=5)
            except Exception:  # the DHT may already be unreachable; records then expire on their own
                logger.warning("Could not announce OFFLINE", exc_info=True)
        if self.handler is not None and self.handler.pusher is not None:
            await self.handler.pusher.close()
        if self.engine is not None:
            await self.engine.stop()
            stats = self.engine.stats
            logger.info(
                "Engine ran %d passes, %.1f rows per pass on average",
                stats.num_passes,
                stats.total_rows / max(stats.num_passes, 1),
            )
        if self.p2p is not None:
            await self.p2p.shutdown()
        if self.dht is not None:
            self.dht.shutdown()
        logger.info("Server stopped")


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
