"""What a real client timed while bench/swarm/sim_vs_real.py ran: its decode steps, its pings and the
links the servers announced, and the spread of each as a log-normal's sigma (what the simulator's
`step_noise` and `ping_noise` take)."""

from __future__ import annotations

import math
import statistics


def watch(swarm) -> tuple[list[float], dict]:
    """From now on: each decode step's seconds per block the client times (as estimates.py counts it), and
    the round trips it sees: its pings (None, server), and the links (server, next) the servers announce in
    its pings' answers and in the records just read (those it routes with), each figure once (a dict)."""
    estimates = swarm.estimates
    per_block: list[float] = []
    seen: dict = {}
    observe = estimates.observe_step
    ping = estimates.ping

    def observed(peer_id: str, seconds: float, num_blocks: int) -> None:
        per_block.append(max(seconds - estimates.rtt.get(peer_id, 0.0), 0.0) / num_blocks)
        observe(peer_id, seconds, num_blocks)

    def pinged(peer_id: str, seconds: float, info) -> None:
        seen.setdefault((None, peer_id), []).append(seconds)
        for other, rtt in (*info.next_pings, *getattr(swarm.view.status_of(peer_id), "next_pings", ())):
            seen.setdefault((peer_id, other), {})[rtt] = None  # a figure there already: a round read again
        ping(peer_id, seconds, info)

    estimates.observe_step = observed
    estimates.ping = pinged
    return per_block, seen


def spread(values: list[float], method: str = "inclusive") -> tuple[float, float, float]:
    """Median, 90th percentile (`method` as statistics.quantiles'), a log-normal's sigma = ln(p90 / median)
    / 1.2816 (clamped to 0..3)."""
    median = statistics.median(values)
    p90 = statistics.quantiles(values, n=10, method=method)[-1] if len(values) > 1 else median
    return median, p90, round(min(max(math.log(p90 / median) / 1.2816, 0.0), 3.0), 3)


def round_trips(seen: dict, names: dict[str, str]) -> dict:
    """Round trips by link and pooled (ms: median, p90, count); the sim's rtt_ms (links' least and greatest
    median) and ping_noise (the median over links of each link's sigma)."""
    links = dict(sorted((f"{names.get(a, 'client')}>{names[b]}", [*v]) for (a, b), v in seen.items()))
    mine = [x for link, values in links.items() if link.startswith("client>") for x in values]
    theirs = [x for link, values in links.items() if not link.startswith("client>") for x in values]
    links.update({"client>*": mine, "server>*": theirs, "all": mine + theirs})
    shown = {k: [round(1000 * x, 2) for x in spread(v)[:2]] + [len(v)] for k, v in links.items() if v}
    medians = [statistics.median(values) for values in seen.values()]
    rtt_ms = [max(round(1000 * min(medians), 1), 0.1), max(round(1000 * max(medians), 1), 0.1)]
    # the noise within a link (the spread between links is rtt_ms's): the median link's sigma
    sigma = statistics.median(spread([*v])[2] for v in seen.values() if len(v) >= 3)
    return {"round_trips_ms_median_p90_n": shown, "rtt_ms": rtt_ms, "ping_noise_sigma": sigma}
