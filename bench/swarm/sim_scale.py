"""How a simulated swarm's routing, recovery and sessions hold up as it grows (corolla sim), JSON.

The same scenario at each size: an 80-block model on servers of three classes (crash10's: 10% H100s with
30-40 blocks, 40% RTX 4090s with 8-16, 50% RTX 3060s with 2-6, most of the home GPUs behind NAT), all
joined within 60 s (before the first
rebalancing checks: at 10,000 servers each check's placement.best_move takes seconds); `--sessions` sessions
arriving between 300 s and 1,500 s, one in `--oracle-every` also routed by the oracle; 10% of the servers
crashing at once at 900 s. For each size: the least-held block before and after the crash, how long some
block had no server, sessions lost (and lost while every block had a server), failovers, per-token
latency and its ratio to the oracle's (median, p95), and the simulation's own wall time.

    python -m bench.swarm.sim_scale [--sizes 100 300 1000] [--sessions 300] [--oracle-every 10]
"""

from __future__ import annotations

import json

from bench.lib.env import parser
from bench.lib.stamp import report
from corolla.sim.report import simulate
from corolla.sim.scenario import Scenario, load


def scenario(servers: int, sessions: int, oracle_every: int) -> Scenario:
    base = load("crash10").model_dump()
    events = [
        {"at": 0, "kind": "join", "count": servers, "every": 60 / servers},
        {"at": 300, "kind": "sessions", "count": sessions, "over": 1200},
        {"at": 900, "kind": "crash", "fraction": 0.1},
    ]
    changes = {"name": f"scale{servers}", "events": events, "duration": 1800, "oracle_every": oracle_every}
    return Scenario.model_validate({**base, **changes})


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--sizes", type=int, nargs="+", default=[100, 300, 1000])
    flags.add_argument("--sessions", type=int, default=300)
    flags.add_argument(
        "--oracle-every", type=int, default=10, help="one session in N also routed by the oracle"
    )
    args = flags.parse_args()
    results = {}
    for size in args.sizes:
        found = simulate(scenario(size, args.sessions, args.oracle_every))
        found.pop("coverage")
        results[str(size)] = found
        print(json.dumps({str(size): found}), flush=True)  # progress: a size at a time
    report(__file__, {"servers": results})


if __name__ == "__main__":
    main()
