"""A server's Prometheus metrics, served on an optional port (`corolla server --metrics-port`).

Live figures (sessions, queued tokens, free cache, passes) are read from the server's status snapshot
(server/status.py) when Prometheus scrapes, so they cost nothing in between and always agree with
`rpc_info` and the DHT announcement; batch sizes and pass times are histograms fed by each engine after
every pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from corolla.engine.async_engine import PassTiming
from corolla.wire.records import ServerStatus

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _LiveFigures(Collector):
    def __init__(self, snapshot: Callable[[], ServerStatus]):
        self.snapshot = snapshot

    def collect(self) -> Iterable:
        status = self.snapshot()
        yield GaugeMetricFamily("corolla_server_sessions", "open inference sessions", status.num_sessions)
        yield GaugeMetricFamily(
            "corolla_server_queued_tokens", "tokens waiting in the engines", status.queued_tokens
        )
        yield GaugeMetricFamily(
            "corolla_server_free_cache_tokens",
            "attention cache left, in tokens (of the primary span)",
            status.cache_tokens_available,
        )
        yield GaugeMetricFamily(
            "corolla_server_cache_tokens", "attention cache size, in tokens", status.cache_tokens_total or 0
        )
        yield GaugeMetricFamily(
            "corolla_server_blocks_per_second",
            "one sequence's decode step, blocks per second, as the latest passes ran (the speed measured "
            "at start until enough have): what clients route by",
            status.speed or 0,
        )
        passes = CounterMetricFamily("corolla_server_engine_passes", "engine passes run")
        passes.add_metric([], status.engine_passes)
        yield passes
        rows = CounterMetricFamily("corolla_server_engine_rows", "sequence rows run, over all passes")
        rows.add_metric([], status.engine_rows)
        yield rows
        computed = CounterMetricFamily(
            "corolla_server_computed_tokens", "positions run through the hosted blocks (every row)"
        )
        computed.add_metric([], status.computed_tokens)
        yield computed
        forked = CounterMetricFamily(
            "corolla_server_forked_tokens",
            "positions sessions started from another session's cache instead of computing them (reused "
            "prefixes)",
        )
        forked.add_metric([], status.forked_tokens)
        yield forked
        yield GaugeMetricFamily(
            "corolla_server_idle_sessions", "ended sessions kept for forks", status.idle_sessions
        )


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.batch_rows = Histogram(
            "corolla_server_batch_rows", "rows per engine pass", buckets=ROW_BUCKETS, registry=self.registry
        )
        self.pass_seconds = Histogram(
            "corolla_server_pass_seconds",
            "duration of an engine pass",
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self._http = None

    def observe_pass(self, timing: PassTiming) -> None:
        """Called by an engine's loop thread after each pass (prometheus-client is thread-safe)."""
        self.batch_rows.observe(timing.rows)
        self.pass_seconds.observe(timing.seconds)

    def watch(self, snapshot: Callable[[], ServerStatus]) -> None:
        """Report the live figures of `snapshot` (read at every scrape)."""
        self.registry.register(_LiveFigures(snapshot))

    def serve(self, host: str, port: int, snapshot: Callable[[], ServerStatus]) -> None:
        """Serve the histograms and the live figures of `snapshot` over HTTP."""
        self.watch(snapshot)
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        logger.info("Metrics at http://%s:%d/metrics", host, port)

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
