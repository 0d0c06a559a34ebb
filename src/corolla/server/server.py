"""A swarm peer serving a span of blocks: its lifecycle (start, drain, stop), and nothing else.

Start order: DHT first (its child process forks from a small parent), then the span's weights, then the
services and the RPC handlers, then the ONLINE announcement, so a client never finds a server that
cannot answer yet. Each collaborator gets what it needs through its constructor. Stop order is the
reverse, with an OFFLINE announcement first so clients stop routing here.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from hivemind import DHT
from hivemind.p2p import P2P

from corolla.config import ServerConfig
from corolla.errors import InvalidRequest
from corolla.models.devices import device_info
from corolla.models.model_config import ModelConfig
from corolla.models.source import dht_prefix_for, resolve_model
from corolla.server.faults import Fault
from corolla.server.handler import TransformerConnectionHandler
from corolla.server.hosting.backend import SpanLoader, adapter_names, compute_settings
from corolla.server.hosting.first_blocks import first_blocks
from corolla.server.hosting.pace import Pace
from corolla.server.hosting.spans import HostedSpans
from corolla.server.hosting.startup_speed import Speed, measure_speed
from corolla.server.inference.forward_passes import PassService
from corolla.server.inference.push import Pusher
from corolla.server.inference.service import InferenceService
from corolla.server.metrics import ServerMetrics
from corolla.server.status import Compute, StatusBoard
from corolla.server.upkeep.announcer import Announcer
from corolla.server.upkeep.link_monitor import LinkMonitor
from corolla.server.upkeep.reach import Reach, public_servers
from corolla.server.upkeep.rebalancer import Rebalancer
from corolla.server.upkeep.speed_check import SpeedCheck
from corolla.swarm.nat.joining import join
from corolla.swarm.p2p.transport import P2PTransport
from corolla.swarm.records.model_listing import lists_model
from corolla.version import __version__
from corolla.wire.records import ServerState, routing_speed

logger = logging.getLogger(__name__)
DHT_EXIT_GRACE = 0.25  # on a signal, how long to wait for the DHT process to exit (when the group got it)


class Server:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.adapters = adapter_names(config.adapters)  # (name, folder) pairs
        self.metrics = ServerMetrics() if config.metrics_port is not None else None
        self.pace = Pace()  # its decode passes' speed (server/hosting/pace.py)
        self.dht: DHT | None = None
        self.p2p: P2P | None = None
        self.spans: HostedSpans | None = None
        self.pusher: Pusher | None = None
        self.inference: InferenceService | None = None
        self.status: StatusBoard | None = None
        self.announcer: Announcer | None = None
        self.links: LinkMonitor | None = None
        self.rebalancer: Rebalancer | None = None
        self.speed_check: SpeedCheck | None = None
        self.reach: Reach | None = None

    async def start(self) -> None:
        config = self.config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        fault = Fault.parse(config.simulate_faulty) if config.simulate_faulty else None  # before joining
        source = resolve_model(config.model)
        self.model = ModelConfig.from_folder(source.path)
        self.device, self.dtype = compute_settings(config, self.model)
        self.dht_prefix = config.dht_prefix or dht_prefix_for(source.name)
        total = self.model.num_hidden_layers
        sharing = self.model.kv_sharing  # layers that use an earlier layer's work in the same pass
        if config.blocks is not None:  # checked before anything starts
            start, end = config.blocks
            if not end <= total:
                inside = f"is not a range inside the model's {total} blocks"
                raise InvalidRequest(f"--blocks {start}:{end} {inside}")
            sharing.check_span(start, end, self.model.model_type)
        self.dht, swarm, dialed_back = join(config.swarm)  # behind NAT: restarted behind relays
        self.peer_id = str(self.dht.peer_id)
        self.p2p = await self.dht.replicate_p2p()
        self.reach = Reach(swarm, dialed_back)
        public = partial(public_servers, self.dht, self.dht_prefix, total, self.peer_id)
        self.reach.start(self.p2p, public, self._announce_now)  # behind NAT: relays reserved while loading
        loader = SpanLoader(
            Path(source.path),
            self.model,
            self.dtype,
            config.engine,
            config.session_timeout,
            max_sessions_per_peer=config.max_sessions_per_peer,
            budgeted=config.memory_budget is not None and config.engine.max_cache_tokens is None,
            pass_delay=config.simulate_slow_ms / 1000,
            adapters=self.adapters,
            pass_listeners=(self.pace.observe, *([self.metrics.observe_pass] if self.metrics else [])),
            quantize=config.quantize,
            fault=fault,
            device=self.device,
        )
        blocks = await self._place(loader)
        precision = config.quantize or str(self.dtype).removeprefix("torch.")
        logger.info(
            "Loading blocks %d:%d of %s (%s weights) on %s", *blocks, source.path, precision, self.device
        )
        adapters = frozenset(name for name, _ in self.adapters)
        self.spans = HostedSpans(self.dht_prefix, loader.load, adapters, config.drain_timeout)
        await self.spans.start(blocks)
        await self._serve()
        await self._report_serving(blocks)

    async def _measure_speed(self, loader: SpanLoader) -> None:
        """Measured on the first blocks a span may hold alone, before choosing blocks (placement weighs the
        swarm by throughput); clients route by its passes' pace once it has served
        (server/hosting/pace.py)."""
        sharing = self.model.kv_sharing
        first = min(cut for cut in range(1, self.model.num_hidden_layers + 1) if sharing.allows(cut))
        probe = await asyncio.to_thread(loader.load_span, (0, first))
        self.speed = await asyncio.to_thread(measure_speed, probe)
        self.pace.batch_growth = self.speed.batch_growth

    async def _place(self, loader: SpanLoader) -> tuple[int, int]:
        """The blocks to start with, weighed by this machine's speed (measured first)."""
        await self._measure_speed(loader)
        where = (self.dht, self.dht_prefix, self.peer_id, self.speed.blocks_per_s or 1.0)
        return await first_blocks(self.config, self.model, self.dtype, self.device, *where)

    async def _report_serving(self, blocks: tuple[int, int]) -> None:
        """The line scripts wait for, then how other peers reach this server (server/upkeep/reach.py)."""
        logger.info("Serving blocks %d:%d of %s as %s", *blocks, self.dht_prefix, self.peer_id)
        await self.reach.report()

    async def _announce_now(self) -> None:
        if self.announcer is not None and self.status.state == ServerState.ONLINE:
            await self.announcer.announce()

    async def _serve(self) -> None:
        """The services over the loaded span, their RPC handlers, then the announcements."""
        config = self.config
        wire = self.model.wire  # what travels between spans (models/handoff.py)
        num_blocks = self.model.num_hidden_layers
        self.pusher = Pusher(P2PTransport(self.p2p), self.dht_prefix)
        self.inference = InferenceService(
            self.spans, config, wire.width, self.pusher, num_blocks, wire.hidden_size, wire
        )
        passes = PassService(self.spans, config, wire.width, wire.hidden_size, wire)
        period = config.announce_period
        dtype = str(self.dtype).replace("torch.", "")
        speed = self.speed
        compute = Compute(dtype, speed.blocks_per_s, device_info(self.device), speed.batch_growth, self.pace)
        # the blocks' keys keep the fastest, by the speed routing expects (the pace, else the measured figure)
        announced = lambda: routing_speed(self.pace.blocks_per_s(), self.speed.blocks_per_s) or 1.0  # noqa: E731
        self.links = LinkMonitor(self.dht, self.p2p, self.spans, self.peer_id, num_blocks, period, announced)
        fingerprint = self.model.fingerprint()
        self.status = StatusBoard(
            self.spans, self.inference, config, __version__, compute, self.links, fingerprint, self.reach
        )
        if self.metrics is not None:
            self.metrics.serve(config.metrics_host, config.metrics_port, self.status.snapshot)
        await TransformerConnectionHandler(self.inference, passes, self.status).add_p2p_handlers(self.p2p)
        lister = lambda: lists_model(self.peer_id, self.dht_prefix, self.links.seen)  # noqa: E731
        self.announcer = Announcer(  # its records' place in the tree: as its links' walk says
            self.dht, self.dht_prefix, period, self.status.snapshot, num_blocks, lister, self.links.place
        )
        self.status.state = ServerState.ONLINE
        await self.links.place_first()  # its records' place in the tree (swarm/records/record_cells.py)
        await self.announcer.announce()
        self.announcer.start()
        self.links.start()
        if config.blocks is None and config.balance_period > 0:
            self.rebalancer = Rebalancer(
                self.dht,
                self.spans,
                self.inference,
                self.announcer,
                self.peer_id,
                num_blocks,
                speed.blocks_per_s or 1.0,
                config.balance_period,
            )
            self.rebalancer.kept = self.links.kept
            self.links.on_read = self.rebalancer.look
            self.rebalancer.start()
        if config.remeasure_period > 0:  # an idle server measures its speed again now and then
            self.speed_check = SpeedCheck(self.spans, config.remeasure_period, period, self._measured_again)
            self.speed_check.start()

    def _measured_again(self, speed: Speed) -> None:
        """An idle server's new figure (server/upkeep/speed_check.py) replaces the one it had."""
        was = self.speed.blocks_per_s
        logger.info("Measured again while idle: %.1f blocks/s (was %.1f)", speed.blocks_per_s, was)
        self.speed = speed
        self.pace.batch_growth = speed.batch_growth
        compute = self.status.compute
        self.status.compute = replace(compute, throughput=speed.blocks_per_s, batch_growth=speed.batch_growth)
        if self.rebalancer is not None:
            self.rebalancer.throughput = speed.blocks_per_s or 1.0

    # --- shutdown -----------------------------------------------------------------------------------------

    async def drain(self, timeout: float, hurry: asyncio.Event) -> None:
        """Stop taking new sessions and wait (up to `timeout`, or until `hurry`) for the open ones to end.

        OFFLINE is announced first, so clients route new sessions elsewhere; a client that still opens a
        session here gets ServerUnavailable and fails over.
        """
        if self.inference is None:
            return
        self.inference.draining = True
        # SIGTERM to the whole process group ends the DHT process (and its daemon) too, a moment later
        await asyncio.to_thread(self.dht.join, DHT_EXIT_GRACE)
        if not self.dht.is_alive():
            logger.warning("The DHT process has exited: no peer can reach this server any more; not draining")
            return
        await self._announce_offline()
        deadline = asyncio.get_running_loop().time() + timeout
        while self.spans.num_sessions and not hurry.is_set():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                logger.warning("Drain timeout: closing %d sessions", self.spans.num_sessions)
                return
            logger.info(
                "Draining: waiting for %d sessions (at most %.0fs more)", self.spans.num_sessions, left
            )
            try:
                await asyncio.wait_for(hurry.wait(), min(left, 1.0))
            except (asyncio.TimeoutError, TimeoutError):
                pass

    async def _announce_offline(self) -> None:
        if self.announcer is None or self.status.state == ServerState.OFFLINE:
            return
        await self.announcer.stop()
        self.status.state = ServerState.OFFLINE
        if not self.dht.is_alive():  # nothing to announce through; the records expire on their own
            return
        try:
            await asyncio.wait_for(self.announcer.announce(), timeout=5)
        except Exception:  # the DHT may already be unreachable; records then expire on their own
            logger.warning("Could not announce OFFLINE", exc_info=True)

    async def stop(self) -> None:
        for part in (self.speed_check, self.rebalancer, self.links, self.reach):
            if part is not None:
                await part.stop()
        await self._announce_offline()
        if self.pusher is not None:
            await self.pusher.close()
        if self.spans is not None:
            await self.spans.stop()
        if self.metrics is not None:
            self.metrics.stop()
        if self.p2p is not None:
            await self.p2p.shutdown()
        if self.dht is not None:
            self.dht.shutdown()
            logger.info("Server stopped")  # not for a server that never got as far as joining the swarm


async def serve(config: ServerConfig, on_ready: Callable[[Server], None] | None = None) -> None:
    """Run a server until SIGINT or SIGTERM, drain its sessions, then shut it down.

    A second signal during the drain stops at once.
    """
    stop = asyncio.Event()
    hurry = asyncio.Event()

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
