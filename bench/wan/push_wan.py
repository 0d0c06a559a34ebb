"""Server-to-server push across an emulated internet: per-token latency with push on and off.

Builds 5 hosts with `../shared/tools/wan/netsim.sh` (network namespaces joined by a bridge, every packet
between hosts delayed `--delay-ms`, so a round trip is twice that; no namespace has a route out). The DHT
peer runs in host 0, three SmolLM2 servers (blocks 0:10, 10:20, 20:30) in hosts 1-3 and the client in
host 4. Without push, each token costs a client round trip per server (3 round trips); with push, the
servers pass the step along and the last one replies at once (client -> 1 -> 2 -> 3 -> client: 4 one-way
delays, 2 round trips). Runs push on and
off alternately, `--runs` generations each, and prints median per-token latencies and their ratio.
Needs root and iptables (`apt-get install iptables`); removes everything it created at the end.

    python -m bench.wan.push_wan [--delay-ms 25] [--new-tokens 32] [--runs 3]
"""

from __future__ import annotations

import json
import statistics
import time

from bench.lib.env import parser, wan_flags
from bench.lib.prompts import chat_ids
from bench.lib.stamp import report
from bench.lib.timing import gaps
from bench.lib.wan import HOSTS, WanSwarm, address
from corolla.launch.local import client_config


def run_client(peers: list[str], new_tokens: int, runs: int) -> None:
    """Inside host 4: generate with push on and off, alternately; print the per-token gaps as JSON."""
    import torch

    from corolla.client.model import DistributedModelForCausalLM

    torch.set_num_threads(1)
    models = {
        push: DistributedModelForCausalLM.from_pretrained(
            "smollm2", config=client_config(address(HOSTS - 1), peers, use_push=push, request_timeout=120)
        )
        for push in (True, False)
    }
    ids = chat_ids(models[True].tokenizer, "Tell me about the sea.")
    between: dict[bool, list[list[float]]] = {True: [], False: []}
    for _ in range(runs + 1):  # the first round warms up connections and is not counted
        for push, model in models.items():
            stamps = [
                time.perf_counter()
                for _ in model.generate_stream(ids, max_new_tokens=new_tokens, ignore_eos=True)
            ]
            between[push].append(gaps(stamps, skip=1))
    for model in models.values():
        model.shutdown()
    print(
        json.dumps(
            {str(push).lower(): [g for run in runs_[1:] for g in run] for push, runs_ in between.items()}
        )
    )


def main() -> None:
    flags = parser(__doc__, wan_flags())
    flags.add_argument("--new-tokens", type=int, default=32)
    flags.add_argument("--runs", type=int, default=3)
    args = flags.parse_args()
    if args.client:
        run_client(args.client, args.new_tokens, args.runs)
        return
    with WanSwarm(args.delay_ms) as swarm:
        measured = swarm.run_client(
            __spec__.name, ["--new-tokens", str(args.new_tokens), "--runs", str(args.runs)]
        )
    on, off = statistics.median(measured["true"]), statistics.median(measured["false"])
    report(
        __file__,
        {
            "model": "SmolLM2-135M-Instruct",
            "servers": 3,
            "one_way_delay_ms": args.delay_ms,
            "round_trip_ms": 2 * args.delay_ms,
            "token_latency_push_ms": round(1000 * on, 1),
            "token_latency_no_push_ms": round(1000 * off, 1),
            "push_vs_no_push": round(on / off, 2),
            "saved_per_token_ms": round(1000 * (off - on), 1),
            "tokens_measured": {"push": len(measured["true"]), "no_push": len(measured["false"])},
        },
    )


if __name__ == "__main__":
    main()
