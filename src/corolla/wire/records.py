"""DHT records and a server's status: what a server announces under each block key it hosts.

Key `"{dht_prefix}.{block_index}"`, subkey = the server's peer id, value = `ServerStatus.to_dict()`,
stored with an expiration so that a dead server's records disappear on their own. The same record is
the reply of `rpc_info`. Records are read from an open network, so every field is validated and a
malformed record is skipped, never trusted.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from corolla.errors import InvalidRequest
from corolla.wire.fields import Fields, pack, unpack

MAX_PINGS = 64
MAX_RELAY_PATHS = 8
# a relayed address as a server announces it: a relay's address, its peer id, then /p2p-circuit
CIRCUIT_ADDRESS = re.compile(
    r"/(ip4|ip6|dns|dns4|dns6)/[0-9A-Za-z.:-]{1,64}/(tcp/\d{1,5}|udp/\d{1,5}/quic-v1)"
    r"/p2p/[1-9A-HJ-NP-Za-km-z]{40,64}/p2p-circuit"
)
QUANTIZED = ("int8", "int4")  # weight precisions that change outputs (models/quantize.py)
RECORD_LIFETIME = 2.5  # announce periods a record lives after it was stored (server/upkeep/announcer.py)
# a record not renewed for this many of its server's announce periods (and STALE_SLACK seconds: an
# announcement's own DHT stores, clocks a little apart) is a gone server's: a live one renews it every
# period. It lives on until RECORD_LIFETIME, but placement and rebalancing stop counting it (swarm/dht.py
# placed_servers)
STALE_PERIODS = 1.5
STALE_SLACK = 5.0


class ServerState(enum.IntEnum):
    OFFLINE = 0
    JOINING = 1
    ONLINE = 2


def missed_renewal(announced_at: float, announce_period: float, now: float) -> bool:
    """Whether a record stored at `announced_at` by a server renewing it every `announce_period` seconds
    should have been renewed by `now` (DHT time: hivemind's, the peers' clocks) and was not."""
    return now - announced_at > STALE_PERIODS * announce_period + STALE_SLACK


def block_key(dht_prefix: str, index: int) -> str:
    return f"{dht_prefix}.{index}"


def block_uids(dht_prefix: str, start: int, end: int) -> str:
    """The `uid` of a request for blocks [start, end): block keys joined by spaces."""
    return " ".join(block_key(dht_prefix, i) for i in range(start, end))


def routing_speed(pace: float | None, throughput: float | None) -> float | None:
    """What routing expects of a server: the pace of its passes, else (none yet, or a meaningless zero)
    the figure measured at start. Servers' records and `corolla sim`'s servers both go through here."""
    return pace if pace else throughput


@dataclass(frozen=True, slots=True)
class RelayPath:
    """How to reach a server behind NAT through one relay: its relayed address (the relay's address, its
    peer id, `/p2p-circuit`; dialers add `/p2p/SERVER`) and the limits the relay granted each connection it
    relays (seconds, bytes each way; None: none), after which it resets that connection."""

    address: str
    time_limit: int | None = None
    data_limit: int | None = None

    @property
    def relay(self) -> str:
        return self.address.rsplit("/p2p/", 1)[1].split("/")[0]

    def to_dict(self) -> dict[str, Any]:
        fields = {"address": self.address, "time_limit": self.time_limit, "data_limit": self.data_limit}
        return {name: value for name, value in fields.items() if value is not None}

    @classmethod
    def read(cls, item: object) -> RelayPath:
        if not isinstance(item, dict):
            raise InvalidRequest(f"a relay path must be a map, got {type(item).__name__}")
        fields = Fields(item, "relay path")
        address = fields.str("address", required=True, max_chars=256) or ""
        if not CIRCUIT_ADDRESS.fullmatch(address):
            raise fields.error("address", "must be a relay's address ending /p2p/RELAY_ID/p2p-circuit")
        return cls(address, fields.int("time_limit", low=0), fields.int("data_limit", low=0))


@dataclass(frozen=True, slots=True)
class ServerStatus:
    """Everything a server says about itself: what it hosts, its limits and its live load.

    One record, one encoding: the reply of `rpc_info` (`to_bytes`) and the value of the server's DHT
    records (`to_dict`) are the same map, so a client's ping and its DHT read can never disagree on a
    field's meaning. Readers accept records of older peers that leave out the optional fields.
    """

    start: int
    end: int
    version: str
    dtype: str  # of the computation (activations, cache)
    inference_max_length: int
    cache_tokens_available: int
    state: ServerState = ServerState.ONLINE
    dht_prefix: str = ""
    model_fingerprint: str = ""  # ModelConfig.fingerprint(): clients skip servers of another model
    max_batch_size: int | None = None  # rows per inference session or forward request
    max_sessions_per_peer: int | None = None  # what one peer may hold here at once
    max_passes_per_peer: int | None = None
    cache_tokens_total: int | None = None
    cache_bytes_per_token: int | None = None  # what a token's cache takes over its blocks, as stored
    num_sessions: int = 0
    queued_tokens: int = 0  # live load: tokens waiting in the server's engines
    engine_passes: int = 0  # engine passes run so far
    engine_rows: int = 0  # sequence rows run in those passes (rows / passes: the mean batch)
    computed_tokens: int = 0  # positions run through the span so far (every row)
    forked_tokens: int = 0  # positions sessions started from another's cache (reused prefixes)
    idle_sessions: int = 0  # ended sessions kept for forks (not in num_sessions)
    steps_from_client: int = 0  # inference steps computed from the client's copy ...
    steps_from_push: int = 0  # ... and from a copy pushed by the previous server
    steps_announced: int = 0  # steps the previous server announced as its pass started (engine/batching.py)
    frames_dropped: int = 0  # frames of a rejected draft's epoch that a rollback dropped before they ran
    throughput: float | None = None  # blocks per second for one decode step; None until measured
    # how much slower a decode step gets per more session in its batch, as measured at start (0.03: 8
    # sessions' step takes 1.21x one's); None: not said (peers too old to measure it)
    batch_growth: float | None = None
    # blocks per second as its latest decode passes ran (server/hosting/pace.py): what routing expects of it;
    # None until it has run enough of them (then `throughput`, the figure placement weighs, stands in)
    pace: float | None = None
    adapters: tuple[str, ...] = ()
    precision: str = ""  # of the weights: the dtype's name, or int8 | int4 when quantized ("" = dtype)
    max_tree_tokens: int = 0  # tokens of one speculative tree step it takes (0: a server without trees)
    encodings: tuple[str, ...] = ()  # hidden-state encodings it reads and writes besides lossless
    next_pings: tuple[tuple[str, float], ...] = ()  # round trips (s) to servers that can take our outputs
    device: str = ""  # where it computes: cpu | cuda | mps ("" from peers too old to say)
    device_name: str = ""  # "NVIDIA H200", a CPU's model name
    device_memory: int | None = None  # bytes of that device's memory (the host's RAM for a CPU)
    reachability: str = ""  # how other peers reach it: direct | relayed | unreachable ("": not said)
    relays: tuple[RelayPath, ...] = ()  # relayed: through which relays, and their limits
    # when the announcement was stored (DHT time) and how often it is renewed (None in rpc_info replies
    # and from peers too old to say): a record not renewed for STALE_PERIODS is a gone server's
    announced_at: float | None = None
    announce_period: float | None = None

    def stale(self, now: float) -> bool:
        """Whether its server has missed renewing this record (see `missed_renewal`)."""
        if self.announced_at is None or self.announce_period is None:
            return False
        return missed_renewal(self.announced_at, self.announce_period, now)

    @property
    def speed(self) -> float | None:
        """Blocks per second of one sequence's decode step as routing expects it (`routing_speed`)."""
        return routing_speed(self.pace, self.throughput)

    @property
    def quantized(self) -> bool:
        """Whether the weights are quantized: outputs differ a little from full precision's."""
        return self.precision in QUANTIZED

    def serves_model(self, fingerprint: str) -> bool:
        """Whether this server's blocks are those of the model with `fingerprint`; a record (or a model)
        without one is taken on trust: peers too old to announce it."""
        return not self.model_fingerprint or not fingerprint or self.model_fingerprint == fingerprint

    def to_dict(self) -> dict[str, Any]:
        record = {name: getattr(self, name) for name in self.__slots__}
        record["state"] = int(self.state)
        record["adapters"] = list(self.adapters)
        record["encodings"] = list(self.encodings)
        record["next_pings"] = {peer: round(rtt, 6) for peer, rtt in self.next_pings}
        record["relays"] = [path.to_dict() for path in self.relays] or None
        return {k: v for k, v in record.items() if v is not None}

    def to_bytes(self) -> bytes:
        return pack(self.to_dict())

    @classmethod
    def from_bytes(cls, raw: bytes) -> ServerStatus:
        return cls._read(unpack(raw, "rpc_info reply"))

    @classmethod
    def from_dict(cls, data: object) -> ServerStatus:
        if not isinstance(data, dict):
            raise InvalidRequest(f"announcement must be a map, got {type(data).__name__}")
        return cls._read(Fields(data, "announcement"))

    @classmethod
    def _read(cls, fields: Fields) -> ServerStatus:
        state = fields.int("state", default=ServerState.ONLINE, low=min(ServerState), high=max(ServerState))
        start = fields.int("start", required=True, low=0)
        end = fields.int("end", required=True, low=1)
        if start is None or end is None or start >= end:
            raise fields.error("end", f"must be greater than start={start}")
        adapters = fields.list("adapters", max_items=256)
        if not all(isinstance(a, str) for a in adapters):
            raise fields.error("adapters", "must be a list of strings")
        encodings = fields.list("encodings", max_items=16)
        if not all(isinstance(e, str) and len(e) <= 32 for e in encodings):
            raise fields.error("encodings", "must be a list of encoding names")
        return cls(
            state=ServerState(state),
            start=start,
            end=end,
            version=fields.str("version", required=True) or "",
            dtype=fields.str("dtype", required=True) or "",
            inference_max_length=fields.int("inference_max_length", required=True, low=1) or 1,
            cache_tokens_available=fields.int("cache_tokens_available", required=True, low=0) or 0,
            dht_prefix=fields.str("dht_prefix", max_chars=256) or "",
            model_fingerprint=fields.str("model_fingerprint", max_chars=64) or "",
            max_batch_size=fields.int("max_batch_size", low=1),
            max_sessions_per_peer=fields.int("max_sessions_per_peer", low=1),
            max_passes_per_peer=fields.int("max_passes_per_peer", low=1),
            cache_tokens_total=fields.int("cache_tokens_total", low=0),
            cache_bytes_per_token=fields.int("cache_bytes_per_token", low=0),
            **{name: fields.int(name, default=0, low=0) or 0 for name in COUNTERS},
            throughput=fields.float("throughput", low=0.0),
            batch_growth=fields.float("batch_growth", low=0.0, high=100.0),
            pace=fields.float("pace", low=0.0),
            adapters=tuple(adapters),
            precision=fields.str("precision", max_chars=16) or "",
            max_tree_tokens=fields.int("max_tree_tokens", default=0, low=0) or 0,
            encodings=tuple(encodings),
            next_pings=_read_pings(fields),
            device=fields.str("device", max_chars=16) or "",
            device_name=fields.str("device_name", max_chars=128) or "",
            device_memory=fields.int("device_memory", low=0),
            reachability=fields.str("reachability", max_chars=16) or "",
            relays=_read_relays(fields),
            announced_at=fields.float("announced_at", low=0.0),
            announce_period=fields.float("announce_period", low=0.0),
        )


# live counts, 0 when a record leaves them out
COUNTERS = (
    "num_sessions",
    "queued_tokens",
    "engine_passes",
    "engine_rows",
    "computed_tokens",
    "forked_tokens",
    "idle_sessions",
    "steps_from_client",
    "steps_from_push",
    "steps_announced",
    "frames_dropped",
)


def _read_pings(fields: Fields) -> tuple[tuple[str, float], ...]:
    pings = fields.map("next_pings")
    if len(pings) > MAX_PINGS or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 3600
        for k, v in pings.items()
    ):
        raise fields.error("next_pings", f"must map at most {MAX_PINGS} peer ids to round trips in seconds")
    return tuple((peer, float(rtt)) for peer, rtt in pings.items())


def _read_relays(fields: Fields) -> tuple[RelayPath, ...]:
    try:
        return tuple(RelayPath.read(item) for item in fields.list("relays", max_items=MAX_RELAY_PATHS))
    except InvalidRequest as e:
        raise fields.error("relays", f"holds a malformed relay path ({e})") from None
