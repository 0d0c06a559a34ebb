"""What a simulation measured, as JSON: coverage through the crashes, the moves that restored it, and
routing's chains against the oracle's."""

from __future__ import annotations

import statistics
import time

from corolla.sim.scenario import Scenario
from corolla.sim.sessions import Sessions
from corolla.sim.simulation import Coverage, Simulation
from corolla.wire.records import block_key


def simulate(scenario: Scenario) -> dict:
    started = time.perf_counter()
    simulation = Simulation(scenario).run()
    return summarize(simulation, time.perf_counter() - started)


def summarize(simulation: Simulation, wall_s: float) -> dict:
    scenario = simulation.scenario
    ratios = sorted(simulation.ratios)
    return {
        "scenario": scenario.name,
        "servers_joined": len(simulation.servers),
        "servers_alive": sum(server.alive for server in simulation.servers.values()),
        "moves": simulation.moves,
        "crashes": [
            recovery(simulation.samples, when, count, scenario) for when, count in simulation.crashes
        ],
        "leaves": [recovery(simulation.samples, when, count, scenario) for when, count in simulation.leaves],
        "routing_vs_oracle": {"routes": len(ratios), **_spread(ratios)},
        "blocks_keys_honest": honest_key_places(simulation),
        "sessions": sessions(simulation.sessions),
        # [time, least-held block by live servers, as placement counts it, sessions open]
        "coverage": [[round(c.time, 1), c.live_min, c.view_min, c.sessions] for c in simulation.samples],
        "simulated_s": scenario.duration,
        "wall_s": round(wall_s, 2),
    }


def honest_key_places(simulation: Simulation) -> float | None:
    """At the end, the share of the blocks' keys' places (the records every reader reads: the fastest
    servers as announced) held by servers of classes that do not inflate their speed (None: no key)."""
    tree = simulation.tree
    places = [
        peer
        for block in range(tree.num_blocks)
        for peer in tree.cells.get(block_key(tree.dht_prefix, block), ())
    ]
    if not places:
        return None
    honest = sum(simulation.servers[peer].kind.inflate == 1.0 for peer in places)
    return _rounded(honest / len(places))


def recovery(samples: list[Coverage], when: float, count: int, scenario: Scenario) -> dict:
    """A crash's (or a graceful leave's) toll on coverage: the least-held block before and after, how long
    some block had no live server, and when every block had one again (in announce periods after it)."""
    before = [c.live_min for c in samples if c.time < when]
    after = [c for c in samples if c.time >= when]
    uncovered = [c.time for c in after if c.live_min == 0]
    restored = next((c.time for c in after if c.time > max(uncovered, default=when) and c.live_min > 0), None)
    return {
        "at_s": when,
        "servers": count,
        "least_held_block_before": before[-1] if before else None,
        "least_held_block_after": min((c.live_min for c in after), default=None),
        "uncovered_s": round(len(uncovered) * scenario.sample_every, 1),
        "restored_after_periods": (
            None
            if restored is None
            else round((restored - when) / scenario.announce_period, 2)
            if uncovered
            else 0.0
        ),
    }


def sessions(found: Sessions) -> dict:
    """What became of the sessions: finished or lost (and lost while every block had a live server), the
    failovers per finished session, per-token latency, and a sample's latency against the oracle's."""
    failovers = found.failovers
    return {
        "started": found.started,
        "finished": found.finished,
        "waited_for_blocks": found.waited,
        "lost": found.lost,
        "lost_while_covered": found.lost_while_covered,
        "lost_for_cache": found.lost_for_cache,
        "turned_away_for_cache": found.turned_away,
        "refusals": found.refusals,
        "chains_through_banned_or_departed": found.misrouted,
        "failovers": found.replaced,
        "stalls_on_silent_acceptors": {"chains": found.stalls, "seconds": _rounded(found.stalled_seconds)},
        "failovers_per_finished_session": {
            "mean": _rounded(statistics.fmean(failovers)) if failovers else None,
            "max": max(failovers, default=None),
        },
        "token_latency_s": _spread(found.latencies),
        "latency_vs_oracle": {"sessions": len(found.ratios), **_spread(found.ratios)},
    }


def _spread(values: list[float]) -> dict:
    ordered = sorted(values)
    if not ordered:
        return {"median": None, "p95": None}
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"median": _rounded(statistics.median(ordered)), "p95": _rounded(p95)}


def _rounded(value: float) -> float:
    return round(value, 3)
