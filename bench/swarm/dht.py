"""What corolla's DHT costs each server as the swarm grows (sim/dht.py: hivemind's own Kademlia code
without sockets), JSON.

For each swarm size: per server and minute, the mean and the largest (the nodes nearest to a key serve
every read and store of it) of messages and bytes, by kind of traffic; requests per operation, lookup
hops, the bytes of a block key's value. Then the growth from each size to the next, beside what a cost
growing like log N (the Kademlia lookups) and like N would do.

With --bounded-reads, reads end at the first copy renewed lately instead of taking every copy of the
key's beam (not corolla's reads: see sim/dht.py), kept as bench/results/dht_bounded_reads.json.

    python -m bench.swarm.dht [--sizes 100 1000 10000] [--blocks 80] [--blocks-per-server 12]
                        [--announce-period 30] [--sessions-per-day 10000] [--samples 20] [--bounded-reads]
"""

from __future__ import annotations

import math
import time

from bench.lib.env import parser
from bench.lib.stamp import report
from corolla.sim.dht import dht_traffic


def growth(small: dict, large: dict) -> dict:
    """How much each cost grew from the `small` swarm to the `large` one."""

    def ratio(a: float, b: float) -> float:
        return round(b / a, 2) if a else float("nan")

    low = small["per_peer_per_minute"]
    high = large["per_peer_per_minute"]
    return {
        "servers": ratio(small["servers"], large["servers"]),
        "log_servers": ratio(math.log(small["servers"]), math.log(large["servers"])),
        "bytes_mean": ratio(low["bytes"]["mean"], high["bytes"]["mean"]),
        "bytes_max": ratio(low["bytes"]["max"], high["bytes"]["max"]),
        "messages_mean": ratio(low["messages"]["mean"], high["messages"]["mean"]),
        "messages_max": ratio(low["messages"]["max"], high["messages"]["max"]),
        "messages_mean_without_pings": ratio(
            low["messages"]["mean"] - low["ping_messages"]["mean"],
            high["messages"]["mean"] - high["ping_messages"]["mean"],
        ),
        "rpcs_per_read": ratio(
            small["rpcs_per_operation"]["client_reads"], large["rpcs_per_operation"]["client_reads"]
        ),
        "hops_per_key": ratio(small["hops_per_key_read"], large["hops_per_key_read"]),
        "value_bytes_per_block_key": ratio(
            small["value_bytes_per_block_key"]["mean"], large["value_bytes_per_block_key"]["mean"]
        ),
    }


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    flags.add_argument("--blocks", type=int, default=80)
    flags.add_argument("--blocks-per-server", type=float, default=12.0)
    flags.add_argument("--announce-period", type=float, default=30.0)
    flags.add_argument("--sessions-per-day", type=float, default=10_000)
    flags.add_argument("--samples", type=int, default=20, help="simulated operations of each kind")
    flags.add_argument("--seed", type=int, default=0)
    flags.add_argument("--bounded-reads", action="store_true", help="model reads at a bounded staleness")
    args = flags.parse_args()
    sessions_per_minute = args.sessions_per_day / 1440
    results = {}
    for size in args.sizes:
        started = time.perf_counter()
        results[str(size)] = dht_traffic(
            size, args.blocks, args.blocks_per_server, args.announce_period, sessions_per_minute,
            args.seed, samples=args.samples, bounded_reads=args.bounded_reads,
        )  # fmt: skip
        results[str(size)]["seconds"] = round(time.perf_counter() - started, 1)
    sizes = [str(size) for size in args.sizes]
    ratios = {f"{b}/{a}": growth(results[a], results[b]) for a, b in zip(sizes, sizes[1:], strict=False)}
    setup = {
        "blocks": args.blocks,
        "blocks_per_server": args.blocks_per_server,
        "announce_period_s": args.announce_period,
        "sessions_per_minute": round(sessions_per_minute, 2),
        "samples": args.samples,
    }
    variant = "bounded_reads" if args.bounded_reads else ""
    report(__file__, {"setup": setup, "servers": results, "growth": ratios}, variant=variant)


if __name__ == "__main__":
    main()
