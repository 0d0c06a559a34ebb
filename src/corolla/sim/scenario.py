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
    """A kind of machine: its share of the servers, its seconds per block of a decode step, and how many
    blocks it holds (drawn uniformly between the bounds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    share: float = Field(gt=0)
    seconds_per_block: float = Field(gt=0)
    min_blocks: int = Field(ge=1)
    max_blocks: int = Field(ge=1)


class Event(BaseModel):
    """At `at` seconds: `crash` a fraction of the live servers at once (they announce nothing more; their
    records expire), make a fraction `leave` gracefully (they announce OFFLINE, take no new sessions and
    end after `--drain-timeout`), `join` `count` new servers, one every `every` seconds, or start
    `sessions`: `count` of them arriving at random times over the next `over` seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    at: float = Field(ge=0)
    kind: Literal["crash", "leave", "join", "sessions"]
    fraction: float = Field(default=0.0, ge=0, le=1)
    count: int = Field(default=0, ge=0, le=1_000_000)
    every: float = Field(default=1.0, gt=0)
    over: float = Field(default=0.0, ge=0)


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
    sample_every: float = Field(default=10.0, gt=0)  # seconds between coverage and routing samples
    routes_per_sample: int = Field(default=2, ge=0, le=1000)
    # sessions: decode steps each runs (drawn uniformly), how much a server's step slows per other session
    # in its batch (per block: seconds_per_block x (1 + batch_growth x others)), and one session in
    # `oracle_every` also routed by the oracle (its search tries every link: slow at a thousand servers)
    session_steps: tuple[int, int] = (64, 512)
    batch_growth: float = Field(default=0.1, ge=0)
    oracle_every: int = Field(default=10, ge=1)
    # sessions come from this many long-lived clients, each keeping its bans and estimates (its pings and
    # the step times it observed) across its sessions; 0: every session is a client of its own
    clients: int = Field(default=0, ge=0, le=1_000_000)
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        for kind in self.classes:
            if kind.min_blocks > kind.max_blocks or kind.max_blocks > self.num_blocks:
                raise ValueError(f"class {kind.name!r}: blocks must lie in 1..{self.num_blocks}, min <= max")
        if not 1 <= self.session_steps[0] <= self.session_steps[1]:
            raise ValueError(
                f"session_steps must be (fewest, most) with 1 <= fewest <= most, got {self.session_steps}"
            )
        if not 0 < self.rtt_ms[0] <= self.rtt_ms[1]:
            raise ValueError(
                f"rtt_ms must be (nearest, farthest) with 0 < nearest <= farthest, got {self.rtt_ms}"
            )
        return self


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
