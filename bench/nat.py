"""Servers behind emulated home routers: the same SmolLM2 chain direct and relayed (JSON).

Builds tests/nat_harness.py's namespaces (needs root, iptables, and ../shared/tools/wan/delayer.py for the
delay), starts 4 `corolla dht --public` relays on the public host, then, for each layout, three SmolLM2
servers (blocks 0:10, 10:20, 20:30) and a client on the relays' host that generates `--new-tokens` greedy
tokens `--repeats` times (after one warm-up):
- direct: every server on a public host of its own (`--public`);
- punched: the first server public, the other two behind cone NATs (found behind NAT by the dial-back:
  reached through a relay, then directly: libp2p's hole punching has them dial out to the client);
- relayed: the first server public, the other two behind symmetric NATs (`--behind-nat`: relay only).
Every packet crossing the bridge is held `--delay-ms` where it arrives: 2 x that between two hosts (a
relayed hop crosses twice). Reports per layout the median time to first token and decode tokens/s, whether
the tokens equal the direct layout's, the share of the client's hops to servers that ended up direct, and
each server's time from its start to serving (for one behind NAT: until a relay took its reservation).
With `--relay-time-limit S` the relays end every connection they relay after S seconds, and the relayed
layout adds a run past it: a client without push (each step goes to each server over its relayed
connection) pauses for S + 5 seconds after half its tokens; reported: its tokens equal, the failovers it
logged (the cut connections), and the time from resuming to its next token. JSON to stdout, logs to stderr.

    sudo python bench/nat.py [--new-tokens 32] [--repeats 3] [--delay-ms 25] [--layouts relayed]
                             [--relay-time-limit 30]
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
LAYOUTS = ("direct", "punched", "relayed")
PROMPT = "The capital of France is"


def start_chain(net: NatHarness, layout: str, model: Path, relays: list[str], env: dict, logs: Path):
    """Three servers of `layout`; (their processes, seconds from each one's start to serving)."""
    servers, ready_s, peer_ids = [], [], []
    for index, blocks in enumerate(SPANS):
        behind = layout != "direct" and index > 0
        host = index + 3 * LAYOUTS.index(layout)  # a public host of its own, per layout
        home = 10 + index + 3 * LAYOUTS.index(layout)
        namespace = net.home(home, symmetric=layout == "relayed") if behind else net.public_host(host)
        public = ["--host", f"11.79.0.{20 + host}", "--public"]
        nat = ["--host", "0.0.0.0", *(["--behind-nat"] if layout == "relayed" else [])]
        where = nat if behind else public
        args = ["server", str(model), "--blocks", blocks, *where, "--no-nat-port-map", "--num-threads", "1"]
        log = logs / f"{layout}-{index}.log"
        started = time.perf_counter()
        servers.append(
            PeerProcess(f"{layout} {blocks}", [*args, *peer_args(relays)], log, env, net.exec(namespace))
        )
        peer_ids.append(servers[-1].wait_for(READY_SERVER, 300).group(1))
        ready_s.append(round(time.perf_counter() - started, 2))
    return servers, ready_s, peer_ids


def client_command(net: NatHarness, model: Path, relays: list[str], new_tokens: int) -> list[str]:
    """tests/nat_client.py on the public host, generating after PROMPT."""
    from transformers import AutoTokenizer

    ids = json.dumps(AutoTokenizer.from_pretrained(model)(PROMPT).input_ids)
    client = [sys.executable, str(CLIENT), str(model), PUBLIC_IP, ids, str(new_tokens), *relays]
    return [*net.exec(net.PUBLIC), *client]


def run_client(net: NatHarness, model: Path, relays: list[str], new_tokens: int, env: dict) -> dict:
    command = client_command(net, model, relays, new_tokens)
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the client failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_past_limit(net: NatHarness, model: Path, relays: list[str], args, env: dict, logs: Path) -> dict:
    """A client without push paused past the relays' time limit halfway (see the module's doc)."""
    resume = logs / "resume-past-limit"
    env = {**env, "NAT_CLIENT_PAUSE_AT": str(args.new_tokens // 2), "NAT_CLIENT_RESUME": str(resume)}
    env["NAT_CLIENT_PUSH"] = "0"
    command = client_command(net, model, relays, args.new_tokens)
    log = logs / "client-past-limit.log"
    with log.open("w") as stderr:
        client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        try:
            if client.stdout.readline().strip() != "paused":
                raise RuntimeError(f"the client failed:\n{log.read_text()[-4000:]}")
            time.sleep(args.relay_time_limit + 5)
            resume.touch()
            out, _ = client.communicate(timeout=600)
        finally:
            client.kill()
            client.wait()
    result = json.loads(out.strip().splitlines()[-1])
    return {
        "paused_s": args.relay_time_limit + 5,
        "failovers_logged": log.read_text().count(" failed (server "),
        "resumed_to_next_token_s": round(result["resumed_to_next_token_s"], 3),
        "tokens": result["tokens"],
    }


def measure(net, layout, model, relays, args, env, logs) -> dict:
    servers, ready_s, peer_ids = start_chain(net, layout, model, relays, env, logs)
    try:
        runs = [run_client(net, model, relays, args.new_tokens, env) for _ in range(args.repeats + 1)][1:]
        past = None
        if args.relay_time_limit and layout == "relayed":
            past = run_past_limit(net, model, relays, args, env, logs)
    finally:
        for server in reversed(servers):
            server.stop(timeout=15)
    connections = runs[-1]["connections"]
    direct = [any("/p2p-circuit" not in a for a in connections.get(peer, [])) for peer in peer_ids]
    measured = {
        "direct_hops": f"{sum(direct)} of {len(direct)}",
        "first_token_s": round(statistics.median(r["first_token_s"] for r in runs), 3),
        "decode_tokens_per_s": round(statistics.median(r["decode_tokens_per_s"] for r in runs), 2),
        "server_start_to_serving_s": ready_s,
        "tokens": runs[0]["tokens"],
    }
    if past is not None:
        past["tokens_equal"] = past.pop("tokens") == measured["tokens"]
        measured["past_relay_time_limit"] = past
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--delay-ms", type=int, default=25, help="one way, per bridge crossing")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument(
        "--relay-time-limit", type=int, default=None, help="seconds (default: the daemon's 30 minutes)"
    )
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
            limit = (
                [] if args.relay_time_limit is None else ["--relay-time-limit", str(args.relay_time_limit)]
            )
            relays = net.start_relays(logs, env, peers, 31340, limit)
            layouts = {
                layout: measure(net, layout, model, relays, args, env, logs) for layout in args.layouts
            }
        finally:
            for peer in reversed(peers):
                peer.stop(timeout=10)
    first = next(iter(layouts.values()))
    direct = layouts.get("direct")
    result = {
        "layouts": {
            name: {k: v for k, v in layout.items() if k != "tokens"} for name, layout in layouts.items()
        },
        "tokens_equal": all(layout["tokens"] == first["tokens"] for layout in layouts.values()),
        **{
            f"{name}_vs_direct_{what}": round(layouts[name][key] / direct[key], 2)
            for name in layouts
            if direct is not None and name != "direct"
            for what, key in (("decode", "decode_tokens_per_s"), ("first_token", "first_token_s"))
        },
        "config": {
            "model": "SmolLM2-135M-Instruct (fp32)",
            "servers": SPANS,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "relays": 4,
            "relay_time_limit_s": args.relay_time_limit,
            "emulated_delay_ms": args.delay_ms,
            "round_trip_ms": 2 * args.delay_ms,
            "logs": str(logs),
            "wall_s": round(time.perf_counter() - started, 1),
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
