"""Servers behind emulated home routers: the same SmolLM2 chain direct and relayed (JSON).

Builds tests/nat_harness.py's namespaces (needs root, iptables, and ../shared/tools/wan/delayer.py for the
delay), starts 4 `corolla dht --public` relays on the public host, then, for each layout, three SmolLM2
servers (blocks 0:10, 10:20, 20:30) and a client on the relays' host that generates `--new-tokens` greedy
tokens `--repeats` times (after one warm-up):
- direct: every server on a public host of its own (`--public`);
- relayed: the first server public, the other two behind symmetric NATs (`--behind-nat`: relay only).
Every packet crossing the bridge is held `--delay-ms` where it arrives: 2 x that between two hosts (a
relayed hop crosses twice). Reports per layout the median time to first token and decode tokens/s, whether
the tokens equal the direct layout's, and each server's time from its start to serving (for one behind
NAT: until a relay took its reservation). No hop ends up direct behind NAT (the bundled libp2p daemon
does not punch holes). JSON to stdout, logs to stderr.

    sudo python bench/nat.py [--new-tokens 32] [--repeats 3] [--delay-ms 25]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from corolla.launch.local import READY_SERVER, PeerProcess
from corolla.models.source import resolve_model
from corolla.swarm.addresses import peer_args
from nat_harness import PUBLIC_IP, NatHarness

CLIENT = Path(__file__).resolve().parents[1] / "tests" / "nat_client.py"
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
SPANS = ["0:10", "10:20", "20:30"]
PROMPT = "The capital of France is"


def start_chain(net: NatHarness, layout: str, model: Path, relays: list[str], env: dict, logs: Path):
    """Three servers of `layout`; (their processes, seconds from each one's start to serving)."""
    servers, ready_s = [], []
    for index, blocks in enumerate(SPANS):
        behind = layout == "relayed" and index > 0
        host = index + (1 if layout == "direct" else 4)  # a public host of its own, per layout
        namespace = net.home(10 + index, symmetric=True) if behind else net.public_host(host)
        public = ["--host", f"11.79.0.{20 + host}", "--public"]
        where = ["--host", "0.0.0.0", "--behind-nat"] if behind else public
        args = ["server", str(model), "--blocks", blocks, *where, "--no-nat-port-map", "--num-threads", "1"]
        log = logs / f"{layout}-{index}.log"
        started = time.perf_counter()
        servers.append(
            PeerProcess(f"{layout} {blocks}", [*args, *peer_args(relays)], log, env, net.exec(namespace))
        )
        servers[-1].wait_for(READY_SERVER, 300)
        ready_s.append(round(time.perf_counter() - started, 2))
    return servers, ready_s


def run_client(net: NatHarness, model: Path, relays: list[str], new_tokens: int, env: dict) -> dict:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)(PROMPT).input_ids
    command = [*net.exec(net.PUBLIC), sys.executable, str(CLIENT), str(model), PUBLIC_IP, json.dumps(ids)]
    out = subprocess.run(
        [*command, str(new_tokens), *relays], capture_output=True, text=True, env=env, timeout=600
    )
    if out.returncode != 0:
        raise RuntimeError(f"the client failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(net, layout, model, relays, args, env, logs) -> dict:
    servers, ready_s = start_chain(net, layout, model, relays, env, logs)
    try:
        runs = [run_client(net, model, relays, args.new_tokens, env) for _ in range(args.repeats + 1)][1:]
    finally:
        for server in reversed(servers):
            server.stop(timeout=15)
    return {
        "first_token_s": round(statistics.median(r["first_token_s"] for r in runs), 3),
        "decode_tokens_per_s": round(statistics.median(r["decode_tokens_per_s"] for r in runs), 2),
        "server_start_to_serving_s": ready_s,
        "tokens": runs[0]["tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--delay-ms", type=int, default=25, help="one way, per bridge crossing")
    args = parser.parse_args()
    if NatHarness.available() is not None:
        sys.exit(NatHarness.available())
    model = resolve_model("smollm2").path
    env = {**os.environ, **ENV}
    logs = Path(tempfile.mkdtemp(prefix="corolla-nat-"))
    peers: list[PeerProcess] = []
    started = time.perf_counter()
    with NatHarness(args.delay_ms) as net:
        try:
            relays = net.start_relays(logs, env, peers, first_port=31340)
            layouts = {
                layout: measure(net, layout, model, relays, args, env, logs)
                for layout in ("direct", "relayed")
            }
        finally:
            for peer in reversed(peers):
                peer.stop(timeout=10)
    direct, relayed = layouts["direct"], layouts["relayed"]
    result = {
        "layouts": {
            name: {k: v for k, v in layout.items() if k != "tokens"} for name, layout in layouts.items()
        },
        "tokens_equal": direct["tokens"] == relayed["tokens"],
        "relayed_vs_direct_decode": round(relayed["decode_tokens_per_s"] / direct["decode_tokens_per_s"], 2),
        "relayed_vs_direct_first_token": round(relayed["first_token_s"] / direct["first_token_s"], 2),
        "config": {
            "model": "SmolLM2-135M-Instruct (fp32)",
            "servers": SPANS,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "relays": 4,
            "emulated_delay_ms": args.delay_ms,
            "round_trip_ms": 2 * args.delay_ms,
            "logs": str(logs),
            "wall_s": round(time.perf_counter() - started, 1),
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
