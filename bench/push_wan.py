"""Server-to-server push across an emulated internet: per-token latency with push on and off.

Builds 5 hosts with `../shared/tools/wan/netsim.sh` (network namespaces joined by a bridge, every packet
between hosts delayed `--delay-ms`, so a round trip is twice that; no namespace has a route out). The DHT
peer runs in host 0, three SmolLM2 servers (blocks 0:10, 10:20, 20:30) in hosts 1-3 and the client in
host 4. Without push, each token costs a client round trip per server (3 round trips); with push, the
servers pass the step along and the last one replies at once (client -> 1 -> 2 -> 3 -> client: 4 one-way
delays, 2 round trips). Runs push on and
off alternately, `--runs` generations each, and prints median per-token latencies and their ratio.
Needs root and iptables (`apt-get install iptables`); removes everything it created at the end.

    python bench/push_wan.py [--delay-ms 25] [--new-tokens 32] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from stamp import report  # bench/stamp.py: stamped into bench/results/
from wan import HOSTS, WanSwarm, address


def run_client(peers: list[str], new_tokens: int, runs: int) -> None:
    """Inside host 4: generate with push on and off, alternately; print the per-token gaps as JSON."""
    import torch

    from corolla.client.model import DistributedModelForCausalLM
    from corolla.config import ClientConfig, SwarmConfig

    torch.set_num_threads(1)
    swarm = SwarmConfig(
        initial_peers=tuple(peers), host=address(HOSTS - 1), nat_port_map=False, client_mode=True
    )
    models = {
        push: DistributedModelForCausalLM.from_pretrained(
            "smollm2", config=ClientConfig(swarm=swarm, use_push=push, request_timeout=120)
        )
        for push in (True, False)
    }
    text = models[True].tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the sea."}], tokenize=False, add_generation_prompt=True
    )
    ids = models[True].tokenizer(text, add_special_tokens=False).input_ids
    gaps: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(runs + 1):  # the first round warms up connections and is not counted
        for push, model in models.items():
            stamps = [
                time.perf_counter()
                for _ in model.generate_stream(ids, max_new_tokens=new_tokens, ignore_eos=True)
            ]
            gaps[push].append([b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)])
    for model in models.values():
        model.shutdown()
    print(
        json.dumps({str(push).lower(): [g for run in runs_[1:] for g in run] for push, runs_ in gaps.items()})
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay between hosts")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--client", nargs="+", help=argparse.SUPPRESS)  # internal: the client, inside host 4
    args = parser.parse_args()
    if args.client:
        run_client(args.client, args.new_tokens, args.runs)
        return
    with WanSwarm(args.delay_ms) as swarm:
        gaps = swarm.run_client(__file__, ["--new-tokens", str(args.new_tokens), "--runs", str(args.runs)])
    on, off = statistics.median(gaps["true"]), statistics.median(gaps["false"])
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
            "tokens_measured": {"push": len(gaps["true"]), "no_push": len(gaps["false"])},
        },
    )


if __name__ == "__main__":
    main()
