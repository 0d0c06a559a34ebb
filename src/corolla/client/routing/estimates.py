"""What a client knows of each server, turned into routing estimates.

Four sources, freshest first: step times this client observed itself (a server that is slow in practice
is seen as slow whatever it announces), round-trip times of its pings (rpc_info, which also reports live
load), the server's own DHT announcement (throughput, sessions), and how many of this client's sessions
run there right now (known at once, so a burst of new sessions spreads over replicas). A ping's load
already counts the sessions this client had there when it answered: only those opened (or closed)
since are added (corolla sim: counting them twice spread a busy client's sessions onto slower servers).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from corolla.swarm.dht import RemoteSpan
from corolla.swarm.policy.plausible import speed_bounds
from corolla.swarm.policy.routing import DEFAULT_RTT, DEFAULT_SECONDS_PER_BLOCK, LOAD_WEIGHT, Estimate, Hop
from corolla.wire.records import ServerStatus

SMOOTHING = 0.3  # weight of a new observation in the moving averages
RTT_FLOOR = 0.003
# a hop silent this many times its slowest recent decode step (and at least SILENCE_FLOOR seconds) is
# pinged, and replaced as a dead one is if it misses the ping (client/rpc/stall_probe.py); a ping may take
# PROBE_RTTS times the server's round trip, and at least PROBE_FLOOR seconds. A frozen server stalls a
# stream for the two together: issue 51 asks for at most 3 s with the replacement's replay
SILENCE_FACTOR = 3
SILENCE_FLOOR = 1.0
PROBE_RTTS = 4
PROBE_FLOOR = 1.0
RECENT_STEPS = 8


def silence_after(step_seconds: float) -> float:
    """How long a decode step of a server whose slowest recent step took `step_seconds` may go unanswered
    before it counts as silent (clients and `corolla sim` alike)."""
    return max(SILENCE_FLOOR, SILENCE_FACTOR * step_seconds)


class ServerEstimates:
    def __init__(self) -> None:
        self.rtt: dict[str, float] = {}
        self.observed: dict[str, float] = {}  # seconds per block per decode step, as this client saw it
        self.infos: dict[str, ServerStatus] = {}
        self.mine: Counter[str] = Counter()  # this client's open span sessions per server
        self._mine_when_pinged: dict[str, int] = {}  # `mine` there when its last ping answered
        self._recent_rtts: dict[str, deque[float]] = {}
        self._recent_steps: dict[str, deque[float]] = {}  # the latest decode steps' round trips

    def has_rtt(self, peer_id: str) -> bool:
        return peer_id in self.rtt

    def ping(self, peer_id: str, seconds: float, info: ServerStatus) -> None:
        # the least of the recent round trips: queueing on a busy machine only ever adds to the network's
        recent = self._recent_rtts.setdefault(peer_id, deque(maxlen=8))
        recent.append(seconds)
        # below RTT_FLOOR, differences are the noise of a busy machine, not distance
        self.rtt[peer_id] = max(min(recent), RTT_FLOOR)
        self.infos[peer_id] = info
        self._mine_when_pinged[peer_id] = self.mine[peer_id]

    def observe_step(self, peer_id: str, seconds: float, num_blocks: int) -> None:
        """A decode step's round trip on `num_blocks` blocks of this server."""
        compute = max(seconds - self.rtt.get(peer_id, 0.0), 0.0) / num_blocks
        self.observed[peer_id] = _smooth(self.observed.get(peer_id), compute)

    def replied(self, peer_id: str, seconds: float) -> None:
        """A small step's round trip on this server (a decode step, a tree, a frame), pushed or not (for
        `silence_limit`)."""
        self._recent_steps.setdefault(peer_id, deque(maxlen=RECENT_STEPS)).append(seconds)

    def silence_limit(self, peer_id: str) -> float | None:
        """How long a small step may go unanswered before its server is pinged (None: no small step seen
        yet, so no measure of its pace: the request timeout applies)."""
        recent = self._recent_steps.get(peer_id)
        return silence_after(max(recent)) if recent else None

    def probe_timeout(self, peer_id: str) -> float:
        """How long a ping to a silent server may take before it counts as frozen."""
        return max(PROBE_FLOOR, PROBE_RTTS * self.rtt.get(peer_id, 0.0))

    def acquire(self, hops: Iterable[Hop]) -> None:
        self.mine.update(hop.peer_id for hop in hops)

    def release(self, hops: Iterable[Hop]) -> None:
        self.mine.subtract(hop.peer_id for hop in hops)

    def estimate(self, span: RemoteSpan, bound: float | None = None) -> Estimate:
        """What routing expects of `span`'s server (`bound`: the most its announced speed counts for)."""
        peer_id = span.peer_id
        seconds_per_block = self.observed.get(peer_id)
        info = self.infos.get(peer_id)
        if seconds_per_block is None:  # its pace (its ping's, the freshest), else its start-up speed
            speed = (info or span.info).speed
            speed = min(speed, bound) if speed and bound else speed
            seconds_per_block = 1 / speed if speed else DEFAULT_SECONDS_PER_BLOCK
        if info is not None:  # live at the ping, this client's sessions then included
            load = max(info.num_sessions + self.mine[peer_id] - self._mine_when_pinged[peer_id], 0)
        else:  # the announcement: a period old, with or without this client's sessions; count them
            load = span.info.num_sessions + max(self.mine[peer_id], 0)
        free = info.cache_tokens_available if info is not None else span.info.cache_tokens_available
        growth = (info or span.info).batch_growth
        return Estimate(
            rtt=self.rtt.get(peer_id, DEFAULT_RTT),
            seconds_per_block=seconds_per_block,
            load=load,
            free_cache=free,
            load_growth=LOAD_WEIGHT if growth is None else growth,
        )

    def estimates(
        self, spans: Iterable[RemoteSpan], among: Iterable[RemoteSpan] | None = None
    ) -> dict[str, Estimate]:
        """Estimates of `spans`' servers, each announced speed bounded by its device's among the servers of
        `among` (the whole read; else `spans`): swarm/policy/plausible.py."""
        spans = list(spans)
        known = spans if among is None else among
        bounds = speed_bounds({s.peer_id: self.infos.get(s.peer_id) or s.info for s in known})
        return {span.peer_id: self.estimate(span, bounds.get(span.peer_id)) for span in spans}


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)
