"""A simulated swarm's scenario, read from a JSON file (src/corolla/sim/scenarios/): its size, its servers'
speeds and memory, the internet between them, and what happens when (joins, crashes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from corolla.errors import InvalidRequest

SCENARIOS = Path(__file__).parent / "scenarios"


class ServerClass(BaseModel):
    """A kind of machine: its share of the servers, how many blocks it holds (drawn uniformly between the
    bounds), how fast a pass over one block is, its memory for attention caches, its upload, and the share
    of its servers behind a home router (NAT).

    Speed, either measured (`seconds_per_block` at one token, plus `seconds_per_token` for each more token
    in the pass) or from the hardware's published memory bandwidth and tensor throughput with the weights'
    bytes per parameter (sim/compute.py scales the pass corolla's engine measured on this machine's CPU,
    sim/calibration.json). A class may lie (`inflate`): its servers announce more than their speed; or take
    sessions and never compute (`silent_acceptor`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    share: float = Field(gt=0)
    min_blocks: int = Field(ge=1)
    max_blocks: int = Field(ge=1)
    seconds_per_block: float | None = Field(default=None, gt=0)
    seconds_per_token: float = Field(default=0.0, ge=0)
    memory_gbps: float | None = Field(default=None, gt=0)
    tflops: float | None = Field(default=None, gt=0)
    bytes_per_param: float = Field(default=2.0, gt=0, le=4)  # 2: bfloat16; 0.5: 4-bit
    cache_gib: float | None = Field(default=None, gt=0)  # None: as many sessions as come
    upload_mbps: float = Field(default=1000.0, gt=0)
    behind_nat: float = Field(default=0.0, ge=0, le=1)
    # a liar's class: its servers announce this many times their true speed (start-up figure and pace)
    inflate: float = Field(default=1.0, ge=1.0, le=10_000.0)
    device: str | None = None  # the device its servers announce (None: the class's name)
    unique_device: bool = False  # each of its servers names a device of its own (no median bounds it)
    # its servers take sessions and answer pings but never compute (client/rpc/stall_probe.py finds them)
    silent_acceptor: bool = False

    @model_validator(mode="after")
    def _speed(self) -> ServerClass:
        if (self.seconds_per_block is None) == (self.memory_gbps is None or self.tflops is None):
            raise ValueError(
                f"class {self.name!r}: give either seconds_per_block or both memory_gbps and tflops"
            )
        return self


class Event(BaseModel):
    """At `at` seconds: `crash` a fraction of the live servers at once (they announce nothing more; their
    records expire), make a fraction `leave` gracefully (they announce OFFLINE, take no new sessions and
    end after `--drain-timeout`), `join` `count` new servers, one every `every` seconds, or start
    `sessions`: `count` of them arriving at random times over the next `over` seconds. A join may name
    the servers' `server_class` (else drawn by the classes' shares) and their `blocks` [start, end) (as
    `corolla server --blocks`: they keep them, never rebalancing; else they place themselves). An event
    happens `repeat` times, `period` seconds apart: waves of servers joining, leaving or crashing."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    at: float = Field(ge=0)
    kind: Literal["crash", "leave", "join", "sessions"]
    fraction: float = Field(default=0.0, ge=0, le=1)
    count: int = Field(default=0, ge=0, le=1_000_000)
    every: float = Field(default=1.0, gt=0)
    over: float = Field(default=0.0, ge=0)
    server_class: str | None = None
    blocks: tuple[int, int] | None = None
    silent: bool = True  # a crash: the machines went silent (else their processes died: connections reset)
    repeat: int = Field(default=1, ge=1, le=10_000)
    period: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _waves(self) -> Event:
        if self.repeat > 1 and self.period <= 0:
            raise ValueError(f"event at {self.at}: repeat={self.repeat} needs a period > 0 between them")
        return self


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    num_blocks: int = Field(ge=1, le=10_000)
    classes: list[ServerClass] = Field(min_length=1)
    events: list[Event] = Field(min_length=1)
    duration: float = Field(gt=0)  # simulated seconds
    announce_period: float = Field(default=60.0, gt=0)  # records expire after 2.5 of these
    balance_period: float = Field(default=120.0, gt=0)  # each server's rebalancing check, +-20%
    rtt_ms: tuple[float, float] = (5.0, 300.0)  # the nearest and farthest two peers may be
    announce_noise: float = Field(default=0.2, ge=0, lt=1)  # announced speed off by up to this share
    # a decode step's time as a client times it: its truth times a log-normal draw of this sigma (0.86:
    # the 90th percentile 3x the median, as timed on this shared machine by bench/swarm/sim_vs_real.py)
    step_noise: float = Field(default=0.3, ge=0, le=3)
    # a server's own decode pass likewise (server/hosting/pace.py times them; no network in it)
    pass_noise: float = Field(default=0.1, ge=0, le=3)
    # a ping's round trip likewise (clients' pings and the links servers announce): 0 on the internet's
    # tens of milliseconds; on one loaded machine a loopback ping takes a busy peer's turn to answer
    ping_noise: float = Field(default=0.0, ge=0, le=3)
    sample_every: float = Field(default=10.0, gt=0)  # seconds between coverage and routing samples
    routes_per_sample: int = Field(default=2, ge=0, le=1000)
    # sessions: their prompts' tokens and the decode steps each runs (drawn uniformly): the cache they
    # take on every server of their chain; the max_length each asks for (the cache routing wants free);
    # one session in `oracle_every` is also routed by the oracle (its search tries every link: slow at a
    # thousand servers)
    prompt_tokens: int = Field(default=256, ge=0)
    session_steps: tuple[int, int] = (64, 512)
    session_tokens: int = Field(default=2048, ge=1, le=8192)  # at most the servers' inference_max_length
    oracle_every: int = Field(default=10, ge=1)
    # the model: bytes a block's attention cache takes per token (Llama 3 70B: 2 x 8 KV heads x 128 x 2
    # bytes), and bytes of a token's hidden state between servers (8192 x 2 bytes)
    kv_bytes_per_token: int = Field(default=4096, ge=1)
    hidden_bytes: int = Field(default=16384, ge=1)
    # the clients: their upload and the share behind a home router; a pair of peers both behind routers
    # connect directly after a hole punch that succeeds this often, else through the server's relay
    client_upload_mbps: float = Field(default=20.0, gt=0)
    clients_behind_nat: float = Field(default=0.8, ge=0, le=1)
    hole_punch_success: float = Field(default=0.7, ge=0, le=1)
    # sessions come from this many long-lived clients, each keeping its bans and estimates (its pings and
    # the step times it observed) across its sessions; 0: every session is a client of its own
    clients: int = Field(default=0, ge=0, le=1_000_000)
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        for kind in self.classes:
            if kind.min_blocks > kind.max_blocks or kind.max_blocks > self.num_blocks:
                raise ValueError(f"class {kind.name!r}: blocks must lie in 1..{self.num_blocks}, min <= max")
        names = {kind.name for kind in self.classes}
        for event in self.events:
            if event.server_class is not None and event.server_class not in names:
                raise ValueError(f"event at {event.at}: no class {event.server_class!r} (classes: {names})")
            if event.blocks is not None and not 0 <= event.blocks[0] < event.blocks[1] <= self.num_blocks:
                raise ValueError(
                    f"event at {event.at}: blocks must be [start, end) within 0..{self.num_blocks}"
                )
        if not 1 <= self.session_steps[0] <= self.session_steps[1]:
            raise ValueError(
                f"session_steps must be (fewest, most) with 1 <= fewest <= most, got {self.session_steps}"
            )
        if self.prompt_tokens + self.session_steps[1] > self.session_tokens:
            raise ValueError(
                f"prompt_tokens + the most session_steps ({self.prompt_tokens} + {self.session_steps[1]}) "
                f"must fit in session_tokens={self.session_tokens}"
            )
        if not 0 < self.rtt_ms[0] <= self.rtt_ms[1]:
            raise ValueError(
                f"rtt_ms must be (nearest, farthest) with 0 < nearest <= farthest, got {self.rtt_ms}"
            )
        return self

    def timeline(self) -> list[tuple[float, Event]]:
        """When each event happens: (time, event), an event repeated `repeat` times `period` apart."""
        return [(e.at + wave * e.period, e) for e in self.events for wave in range(e.repeat)]


def load(name_or_path: str) -> Scenario:
    """A scenario by file path, or by the name of one in src/corolla/sim/scenarios/; InvalidRequest names
    what is wrong."""
    path = Path(name_or_path)
    if not path.exists():
        path = SCENARIOS / f"{name_or_path}.json"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in SCENARIOS.glob("*.json")))
        raise InvalidRequest(f"no scenario file {name_or_path!r} (bundled: {known})")
    try:
        return Scenario.model_validate(json.loads(path.read_text()))
    except (ValueError, ValidationError) as e:
        raise InvalidRequest(f"scenario {path}: {e}") from None
