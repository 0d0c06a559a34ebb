"""How long a client takes to choose a chain as the swarm grows (swarm/policy/routing.py `choose_chain`),
JSON.

A random swarm of an 80-block model: each server holds 8 to 24 consecutive blocks (the first and the
last block always held), round trips of 5 to 300 ms, 1 to 20 ms per block, 0 to 5 sessions; every server
announces measured round trips to `--links` random others (what push's link costs use; the rest are
guessed from the client's round trips). For each swarm size, the median time of `--repeats` routes over
the whole model, with and without push, and how many hops the chain has.

    python -m bench.swarm.routing [--sizes 100 300 1000 3000] [--repeats 3] [--links 8]
"""

from __future__ import annotations

import random
import statistics
import time

from bench.lib.env import parser
from bench.lib.stamp import report
from corolla.swarm.dht import RemoteSpan
from corolla.swarm.policy.routing import Estimate, choose_chain
from corolla.wire.records import ServerStatus

BLOCKS = 80


def swarm(size: int, links_per_server: int, rng: random.Random):
    """(spans, estimates, links) of a random swarm of `size` servers."""
    spans, estimates = [], {}
    for i in range(size):
        length = rng.randint(8, 24)
        start = [0, BLOCKS - length][i] if i < 2 else rng.randint(0, BLOCKS - length)
        info = ServerStatus(start, start + length, "bench", "float16", 8192, 1 << 20)
        spans.append(RemoteSpan(f"server{i}", start, start + length, info))
        estimates[f"server{i}"] = Estimate(
            rng.uniform(0.005, 0.3), rng.uniform(0.001, 0.02), rng.randint(0, 5)
        )
    peers = list(estimates)
    links = {p: {q: rng.uniform(0.005, 0.3) for q in rng.sample(peers, links_per_server)} for p in peers}
    return spans, estimates, links


def timed(spans, estimates, links, push: bool, repeats: int, rng: random.Random) -> dict:
    times, hops = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        chain = choose_chain(spans, 0, BLOCKS, estimates=estimates, links=links, push=push, rng=rng)
        times.append(time.perf_counter() - started)
        hops = len(chain)
    return {"median_s": round(statistics.median(times), 4), "hops": hops}


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--sizes", type=int, nargs="+", default=[100, 300, 1000, 3000])
    flags.add_argument("--repeats", type=int, default=3)
    flags.add_argument("--links", type=int, default=8, help="measured round trips each server announces")
    args = flags.parse_args()
    rng = random.Random(0)
    results = {}
    for size in args.sizes:
        spans, estimates, links = swarm(size, min(args.links, size), rng)
        results[str(size)] = {
            "push": timed(spans, estimates, links, True, args.repeats, rng),
            "no_push": timed(spans, estimates, links, False, args.repeats, rng),
        }
    report(__file__, {"blocks": BLOCKS, "servers": results})


if __name__ == "__main__":
    main()
