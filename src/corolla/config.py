"""Frozen configuration objects, built once (by the CLI or a caller) and passed down.

Constructors take one of these instead of dozens of keyword arguments. Each validates its ranges when it
is built, so a bad value fails at once with its name (and the CLI option that sets it), never later
inside a component. Numbers derived at run time (the cache size chosen from free memory, the model's EOS
id) belong to the component that computes them and are never written back here.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from corolla.errors import InvalidRequest

DTYPES = ("float32", "float16", "bfloat16", "auto")
QUANTIZE_MODES = ("int8", "int4")  # weight-only, through torchao (models/quantize.py)
EMBEDDING_POOLINGS = ("mean", "last")  # of an input's final hidden states (client/training/embeddings.py)
WIRE_ENCODINGS = ("lossless", "float16", "blockwise8")  # of hidden states between hops (wire/tensors.py)
# how other peers reach this one: the owner says, or a server has peers dial it back (swarm/nat/joining.py)
REACHABILITY = ("auto", "public", "behind-nat")
RELAY_LIMITS = ("relay_time_limit", "relay_data_limit_mib", "relay_circuits")  # SwarmConfig's


def _check(
    config: object, low: float, names: tuple[str, ...], *, strict: bool = True, cli: bool = True
) -> None:
    """Every field in `names` that is not None must be > low (or >= low when not strict); the error names
    the field and (`cli`) the command-line option that sets it."""
    for name in names:
        value = getattr(config, name)
        if value is not None and (value <= low if strict else value < low):
            bound = f"greater than {low}" if strict else f"at least {low}"
            option = f" (--{name.replace('_', '-')})" if cli else ""
            raise InvalidRequest(f"{name}{option} must be {bound}, got {value}")


def _one_of(config: object, name: str, choices: tuple[str, ...], cli: bool = True) -> None:
    """The field `name`, unless None, must be one of `choices` (the error as `_check`'s)."""
    value = getattr(config, name)
    if value is not None and value not in choices:
        option = f" (--{name.replace('_', '-')})" if cli else ""
        raise InvalidRequest(f"{name}{option} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class SwarmConfig:
    """How a peer joins the swarm's DHT."""

    initial_peers: tuple[str, ...] = ()
    host: str = "0.0.0.0"
    port: int = 0
    announce_host: str | None = None  # address other peers should dial, when host is 0.0.0.0 or behind NAT
    # UPnP / NAT-PMP port mapping toward the LAN gateway: right for a home server on the internet, wrong on
    # loopback and in tests. None = on unless every listen address is a loopback address.
    nat_port_map: bool | None = None
    identity_path: str | None = None  # the peer's key file (fixes its peer id); None: a new key per run
    client_mode: bool = False
    # a private swarm: only these peer ids may use this peer, and only their DHT records count (None: open)
    allowed_peers: frozenset[str] | None = None
    # "public": dialable as it is, and a relay for peers behind NAT; "behind-nat": reachable only through
    # relays it holds reservations on (swarm/nat/reservations.py), a DHT client; "auto": a server asks peers
    # to dial it back and becomes one or the other (swarm/nat/joining.py)
    reachability: str = "auto"
    relay: bool = True  # a reachable peer relays for peers behind NAT (False: it refuses to)
    # what a reachable peer relays for peers behind NAT (swarm/nat/relay_service.py), per relayed connection:
    # its seconds and MiB each way, and the connections per peer at once; None: libp2p daemon's 30 min, 4 GiB,
    # 16
    relay_time_limit: float | None = None
    relay_data_limit_mib: int | None = None
    relay_circuits: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidRequest(f"port (--port) must lie in 0..65535, got {self.port}")
        if self.announce_host is not None and self.port == 0:  # peers would be told no port to dial
            raise InvalidRequest(
                f"announce_host (--announce-host {self.announce_host}) needs a fixed port (--port): the "
                "port other peers dial, forwarded to this machine if it is behind NAT"
            )
        _one_of(self, "reachability", REACHABILITY, cli=False)
        _check(self, 0, RELAY_LIMITS)
        given = [name for name in RELAY_LIMITS if getattr(self, name) is not None]
        if given and self.reachability == "behind-nat":
            option = f"--{given[0].replace('_', '-')}"
            raise InvalidRequest(
                f"{given[0]} ({option}) limits relaying, which a peer --behind-nat never does"
            )

    @property
    def host_maddrs(self) -> list[str]:
        version = "ip6" if ":" in self.host else "ip4"
        return [f"/{version}/{self.host}/tcp/{self.port}"]

    @property
    def announce_maddrs(self) -> list[str] | None:
        if self.announce_host is None or self.port == 0:
            return None
        version = "ip6" if ":" in self.announce_host else "ip4"
        return [f"/{version}/{self.announce_host}/tcp/{self.port}"]

    @property
    def use_nat_port_map(self) -> bool:
        if self.nat_port_map is not None:
            return self.nat_port_map
        try:
            return not ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return True


@dataclass(frozen=True)
class EngineConfig:
    """A server's continuous-batching engine: its attention cache and what one pass may hold."""

    # the attention cache pool, in tokens of a session spanning every hosted block, in pages of page_size
    # positions; None: the server takes a quarter of the memory available at start (server/hosting/spans.py)
    max_cache_tokens: int | None = None
    page_size: int = 16  # positions per cache page (`--block-size` in older versions)
    max_batch_tokens: int = 128  # tokens per engine pass (decode steps + prefill chunks)
    max_batch_rows: int = 64  # sequence rows per engine pass; 1 turns batching across sessions off
    max_sessions: int = 256  # open inference sessions at once
    # a pass waits for the sessions whose steps are due within this long (or two passes' time, if longer):
    # announced by the previous server, or expected by their cycle (bigger batches cost little more than
    # small ones); 0 never waits (engine/batching.py)
    max_batch_wait_ms: float = 50.0
    # forward/backward work runs this many tokens (whole rows, at least one) per pass, between inference
    # passes: smaller slices keep inference latency steady under training load, bigger ones train faster
    forward_slice_tokens: int = 64
    # sessions whose client asked to keep them for later forks (reused prefixes), kept idle after their
    # stream ends: at most this many per peer, each for at most idle_session_timeout seconds, always the
    # first taken back when cache or session slots run short (engine/idle.py); 0 keeps none
    max_idle_sessions_per_peer: int = 16
    idle_session_timeout: float = 600.0

    def __post_init__(self) -> None:
        _check(self, 0, ("page_size", "max_batch_tokens", "max_batch_rows", "max_sessions"))
        _check(self, 0, ("max_idle_sessions_per_peer", "idle_session_timeout"), strict=False)
        _check(self, 0, ("forward_slice_tokens", "max_cache_tokens"))
        _check(self, 0, ("max_batch_wait_ms",), strict=False)
        if self.max_cache_tokens is not None and self.max_cache_tokens < self.page_size:
            raise InvalidRequest(
                f"max_cache_tokens (--max-cache-tokens) must hold at least one page of {self.page_size} "
                f"tokens, got {self.max_cache_tokens}"
            )


@dataclass(frozen=True)
class ServerConfig:
    model: str  # a folder, a GGUF file, a hub id or the bundled alias (see models/source.py)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    dht_prefix: str | None = None  # default: derived from the model's name
    blocks: tuple[int, int] | None = None  # [start, end); None: the server places itself and rebalances
    num_blocks: int | None = None  # None: as many as memory_budget holds
    memory_budget: int | None = None  # bytes for block weights + cache; None: half the available memory
    balance_period: float = 120.0  # how often a self-placed server checks whether moving would help
    remeasure_period: float = 1800.0  # an idle server measures its speed again this often (0: never)
    dtype: str | None = None  # of computation and cache; None: float32 on a CPU, bfloat16 on a GPU with it
    inference_max_length: int = 4096  # the longest session (prompt + generated tokens) a client may open
    max_batch_size: int = 64  # rows per inference session or forward request
    max_forward_tokens: int = 8192  # batch * length of one forward request
    max_tree_tokens: int = 64  # batch * tokens of one speculative tree step (at most max_batch_tokens)
    step_timeout: float = 300.0  # an inference session waiting longer than this for its next step is closed
    session_timeout: float = 1800.0  # no session lives longer than this
    # fair share: what one peer (a client, or an API gateway of many users) may hold here at once
    max_sessions_per_peer: int = 64  # the cache: shared equally by the peers needing it (engine/scheduler.py)
    max_passes_per_peer: int = 16  # forward/backward requests running or queued
    announce_period: float = 30.0  # re-announce this often; records expire after 2.5 periods
    drain_timeout: float = 60.0  # on SIGTERM, open sessions get this long to finish
    num_threads: int | None = None  # torch threads for compute (None: torch's default)
    simulate_slow_ms: float = 0.0  # testing aid: sleep this long after every engine pass
    simulate_faulty: str | None = None  # testing aid: compute wrong outputs on purpose (server/faults.py)
    adapters: tuple[str, ...] = ()  # PEFT LoRA folders served for this span (NAME=PATH or PATH)
    quantize: str | None = None  # weight-only int8 | int4 through torchao (models/quantize.py); None: off
    device: str | None = None  # cpu | cuda | cuda:N | mps; None: the best available (models/devices.py)
    metrics_port: int | None = None  # serve Prometheus metrics over HTTP on this port (None: do not)
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        _check(self, 0, ("inference_max_length", "max_batch_size", "max_forward_tokens", "step_timeout"))
        _check(self, 0, ("session_timeout", "announce_period", "num_blocks", "memory_budget", "num_threads"))
        _check(self, 0, ("max_sessions_per_peer", "max_passes_per_peer", "max_tree_tokens"))
        if self.max_tree_tokens > self.engine.max_batch_tokens:
            raise InvalidRequest(
                f"max_tree_tokens (--max-tree-tokens) must be at most max_batch_tokens "
                f"(--max-batch-tokens, {self.engine.max_batch_tokens}): a tree runs in one pass, got "
                f"{self.max_tree_tokens}"
            )
        zero_allowed = ("balance_period", "remeasure_period", "drain_timeout", "simulate_slow_ms")
        _check(self, 0, zero_allowed, strict=False)
        if self.blocks is not None and not 0 <= self.blocks[0] < self.blocks[1]:
            raise InvalidRequest(f"blocks (--blocks) must be A:B with 0 <= A < B, got {self.blocks}")
        _one_of(self, "quantize", QUANTIZE_MODES)
        _one_of(self, "dtype", DTYPES)
        if self.metrics_port is not None and not 0 < self.metrics_port <= 65535:
            port = self.metrics_port
            raise InvalidRequest(f"metrics_port (--metrics-port) must lie in 1..65535, got {port}")


MAX_PIPELINE = 4  # steps a session may send ahead of their replies (a server reads no more meanwhile)


@dataclass(frozen=True)
class SpeculationConfig:
    """Speculative decoding on the client (client/generation/speculative.py): a drafter guesses the next
    tokens, the swarm verifies them in one step, and the output is exactly what decoding without a draft
    gives."""

    # "lookup": n-grams of the text (no model); "mtp": the checkpoint's own multi-token prediction layers
    # (decoding/mtp.py); else a causal LM sharing the target's tokenizer (a folder, .gguf, hub id, smollm2)
    draft: str = "lookup"
    quantize: str | None = None  # the draft model's weights: int8 | int4 (torchao), or as stored
    device: str = "cpu"  # where a draft model runs: cpu | cuda | cuda:N | mps | auto (models/devices.py)
    max_depth: int = 8  # drafted tokens along any path
    # a tree's branching: a draft model's tokens per level (default 1: a chain), prompt lookup's places
    # the last tokens appeared (default 2); 1 drafts a chain, more a SpecExec-style tree
    width: int | None = None
    max_tokens: int = 32  # drafted tokens per step (also bounded by the servers' max_tree_tokens)
    adaptive: bool = True  # the depth follows the measured acceptance and step times (False: max_depth)
    pipeline: int = 3  # most drafted chains in flight, 1 to 4 (client/generation/pipelined.py); never trees

    def __post_init__(self) -> None:
        _check(self, 0, ("max_depth", "width", "max_tokens", "pipeline"), cli=False)
        if self.pipeline > MAX_PIPELINE:
            limit = f"at most {MAX_PIPELINE} drafts in flight"
            raise InvalidRequest(f"pipeline must be {limit}, got {self.pipeline}")
        if not self.draft:
            raise InvalidRequest("draft must be 'lookup' or a model")
        _one_of(self, "quantize", QUANTIZE_MODES, cli=False)

    @property
    def uses_model(self) -> bool:
        return self.draft != "lookup"


@dataclass(frozen=True)
class ClientConfig:
    swarm: SwarmConfig = field(default_factory=lambda: SwarmConfig(host="127.0.0.1", client_mode=True))
    dht_prefix: str | None = None
    request_timeout: float = 60.0  # one step or forward call
    routing_timeout: float = 30.0  # how long to wait for the swarm to cover every block
    allowed_servers: tuple[str, ...] | None = None  # restrict routing to these peer ids
    blocked_servers: tuple[str, ...] = ()
    max_retries: int = 8  # failed servers replaced per step (or forward call) before giving up
    failover_timeout: float = 120.0  # and no step keeps replacing servers for longer than this
    ban_time: float = 15.0  # a failed server is avoided this long, doubling on each further failure
    refresh_period: float = 10.0  # re-read the DHT and ping the servers this often
    use_push: bool = True  # ask each server to push its outputs straight to the next one
    active_adapter: str | None = None  # a LoRA adapter by its name on servers; only servers with it are used
    exact: bool = False  # route only through servers with full-precision weights (no int8/int4 servers)
    max_request_tokens: int = 4096  # rows * length per forward/backward request (bigger batches are split)
    dtype: str = "float32"  # of the local embeddings and head, and of the hidden states sent
    speculation: SpeculationConfig | None = None  # speculative decoding (None: off)
    # hidden states between hops: "lossless", or, lossy and opt-in, "float16" or "blockwise8" (8-bit), for
    # tensors of at least 32 KiB (prefills): less to send on slow links (wire/tensors.py)
    wire_encoding: str = "lossless"
    # the share of each server's inference steps and training passes re-run elsewhere
    # (client/checks/spot_checks.py)
    spot_checks: float = 0.0
    # reused prefixes: this many ended sessions are kept (by their servers) and indexed by their tokens, so
    # a generation sharing a prefix with one sends and computes only the rest (client/generation/prefixes.py);
    # 0: off
    prefix_cache: int = 16

    def __post_init__(self) -> None:
        _check(self, 0, ("request_timeout", "refresh_period", "max_request_tokens"), cli=False)
        _check(self, 0, ("prefix_cache", "routing_timeout"), strict=False)  # command-line options too
        if not 0 <= self.spot_checks <= 1:
            raise InvalidRequest(f"spot_checks (--spot-checks) must lie in [0, 1], got {self.spot_checks}")
        _check(self, 0, ("max_retries", "failover_timeout", "ban_time"), strict=False, cli=False)
        _one_of(self, "wire_encoding", WIRE_ENCODINGS, cli=False)


@dataclass(frozen=True)
class ApiConfig:
    """`corolla api`'s own settings (its client's are a ClientConfig), checked for the CLI and build_app."""

    host: str = "127.0.0.1"  # HTTP address
    port: int = 8000  # HTTP port
    served_model_name: str | None = None  # the model id clients pass (None: the model's name)
    max_model_len: int = 4096  # prompt + completion a request may ask for (capped by the model's context)
    stats_interval: float = 10.0  # seconds between log lines of running requests and throughput (0: never)
    embedding_pooling: str = "mean"  # how /v1/embeddings pools final hidden states: mean or last
    api_keys: tuple[str, ...] = ()  # bearer keys every /v1 and /api route needs (none: open)
    allowed_origins: tuple[str, ...] = ()  # CORS origins (or "*")
    stored_responses: int = 1000  # Responses API answers kept per API key for previous_response_id
    chat_template: str | None = None  # a Jinja file, or a bundled template's name, instead of the model's
    default_temperature: float | None = None  # for requests that set none (None: each API's default)

    def __post_init__(self) -> None:
        if not 0 < self.port <= 65535:
            raise InvalidRequest(f"port (--port) must lie in 1..65535, got {self.port}")
        _check(self, 2, ("max_model_len",), strict=False)
        _check(self, 0, ("stats_interval", "stored_responses", "default_temperature"), strict=False)
        if (hot := self.default_temperature or 0) > 2:
            raise InvalidRequest(f"default_temperature (--default-temperature) must be at most 2, got {hot}")
        _one_of(self, "embedding_pooling", EMBEDDING_POOLINGS)
        if any(not key.strip() for key in self.api_keys):
            raise InvalidRequest("api_keys (--api-key) must not be empty")
