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
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NETSIM = Path(__file__).resolve().parents[2] / "shared" / "tools" / "wan" / "netsim.sh"
HOSTS = 5
SPANS = [(0, 10), (10, 20), (20, 30)]


def address(host: int) -> str:
    return f"10.77.0.{10 + host}"


def netns(host: int) -> list[str]:
    return ["ip", "netns", "exec", f"wan-h{host}"]


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
    from corolla.models.source import resolve_model
    from corolla.swarm.addresses import peer_args
    from corolla.swarm.local import READY_SERVER, PeerProcess

    resolve_model("smollm2")  # convert once, before any server needs it
    subprocess.run(
        ["bash", str(NETSIM), "up", str(HOSTS), str(args.delay_ms)], check=True, capture_output=True
    )
    workdir = Path(tempfile.mkdtemp(prefix="corolla-wan-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    peers: list[PeerProcess] = []
    try:
        dht = PeerProcess(
            "dht", ["dht", "--host", address(0), "--no-nat-port-map"], workdir / "dht.log", env, netns(0)
        )
        peers.append(dht)
        initial = [dht.wait_for(re.compile(r"--initial-peers (/ip4/10\.77\.0\.10/\S+)"), 120).group(1)]
        for host, (start, end) in enumerate(SPANS, start=1):
            server_args = ["server", "smollm2", "--blocks", f"{start}:{end}", "--host", address(host),
                           "--no-nat-port-map", "--num-threads", "1", *peer_args(initial)]  # fmt: skip
            peers.append(
                PeerProcess(f"server {host}", server_args, workdir / f"server{host}.log", env, netns(host))
            )
        for server in peers[1:]:
            server.wait_for(READY_SERVER, 300)
        client = [sys.executable, __file__, "--client", *initial, "--new-tokens", str(args.new_tokens),
                  "--runs", str(args.runs)]  # fmt: skip
        out = subprocess.run(
            [*netns(HOSTS - 1), *client], capture_output=True, text=True, env=env, timeout=1800
        )
        if out.returncode != 0:
            raise RuntimeError(f"the client failed:\n{out.stderr[-3000:]}")
        gaps = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        for peer in reversed(peers):
            peer.stop(timeout=10)
        subprocess.run(["bash", str(NETSIM), "down"], check=False, capture_output=True)
    on, off = statistics.median(gaps["true"]), statistics.median(gaps["false"])
    print(
        json.dumps(
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
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
