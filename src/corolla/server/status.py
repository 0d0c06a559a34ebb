"""A server's status: one snapshot, read by everything that reports on the server.

`rpc_info`, the DHT announcement, the Prometheus metrics and (through the DHT) `corolla status` and the
dashboard all show `StatusBoard.snapshot()`, a `ServerStatus` built from the hosted spans' engine
snapshots, the inference service's counters and the links to the next servers. Nothing copies these
figures by hand into another record, so no two reports can disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from corolla.config import ServerConfig
from corolla.models.devices import DeviceInfo
from corolla.server.hosting.pace import Pace
from corolla.server.hosting.spans import HostedSpans
from corolla.server.inference.service import InferenceService
from corolla.server.upkeep.link_monitor import LinkMonitor
from corolla.server.upkeep.reach import Reach
from corolla.wire.records import ServerState, ServerStatus
from corolla.wire.tensors import supported_encodings


@dataclass(frozen=True)
class Compute:
    """What the server computes with: the dtype's name, the measured blocks per second (placement weighs
    it: measured at start, and again now and then while idle: server/upkeep/speed_check.py), the device,
    and the measured slowdown per more session in a batch; then the pace of its own decode passes
    (server/hosting/pace.py: routing's figure)."""

    dtype: str
    throughput: float | None
    device: DeviceInfo
    batch_growth: float | None = None
    pace: Pace | None = None


class StatusBoard:
    def __init__(
        self,
        spans: HostedSpans,
        inference: InferenceService,
        config: ServerConfig,
        version: str,
        compute: Compute,
        links: LinkMonitor | None = None,
        model_fingerprint: str = "",
        reach: Reach | None = None,
    ):
        self.spans = spans
        self.inference = inference
        self.config = config
        self.links = links
        self.model_fingerprint = model_fingerprint
        self.version = version
        self.compute = compute
        self.reach = reach  # how other peers reach it (server/upkeep/reach.py)
        self.state = ServerState.JOINING  # ONLINE once it serves, OFFLINE when it leaves

    def snapshot(self) -> ServerStatus:
        """What the server reports now (callable from any thread: it only reads finished snapshots)."""
        primary = self.spans.primary
        stats = self.spans.engine_stats()  # the primary's first
        return ServerStatus(
            state=self.state,
            start=primary.blocks[0],
            end=primary.blocks[1],
            version=self.version,
            dtype=self.compute.dtype,
            inference_max_length=self.config.inference_max_length,
            cache_tokens_available=stats[0].free_cache_tokens,
            dht_prefix=self.spans.dht_prefix,
            model_fingerprint=self.model_fingerprint,
            max_batch_size=self.config.max_batch_size,
            max_sessions_per_peer=self.config.max_sessions_per_peer,
            max_passes_per_peer=self.config.max_passes_per_peer,
            cache_tokens_total=stats[0].total_cache_tokens,
            cache_bytes_per_token=primary.span.cache_bytes_per_token,
            num_sessions=self.spans.num_sessions,
            queued_tokens=sum(s.queued_tokens for s in stats),
            engine_passes=sum(s.num_passes for s in stats),
            engine_rows=sum(s.total_rows for s in stats),
            computed_tokens=sum(s.computed_tokens for s in stats),
            forked_tokens=sum(s.forked_tokens for s in stats),
            idle_sessions=sum(s.num_idle for s in stats),
            steps_from_client=self.inference.steps_from_client,
            steps_from_push=self.inference.steps_from_push,
            steps_announced=self.inference.steps_announced,
            frames_dropped=self.inference.frames_dropped,
            throughput=self.compute.throughput,
            batch_growth=self.compute.batch_growth,
            pace=self.compute.pace.blocks_per_s() if self.compute.pace is not None else None,
            adapters=tuple(sorted(self.spans.adapters)),
            precision=primary.span.precision,
            max_tree_tokens=self.config.max_tree_tokens,
            encodings=tuple(e for e in supported_encodings() if e != "lossless"),
            next_pings=tuple(self.links.pings.items()) if self.links is not None else (),
            device=self.compute.device.kind,
            device_name=self.compute.device.name,
            device_memory=self.compute.device.total_memory,
            reachability=self.reach.reachability if self.reach is not None else "",
            relays=self.reach.paths if self.reach is not None else (),
        )
