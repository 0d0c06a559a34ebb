"""Servers behind emulated home routers in a swarm whose only public peer is `corolla dht` started as the
README says (no --public), every server started plainly: how soon they serve, and what relays cost (JSON).

Builds tests/nat_harness.py's namespaces (needs root, iptables, and ../shared/tools/wan/delayer.py for the
delay; every packet crossing the bridge is held `--delay-ms` where it arrives: 2 x that between two hosts)
and runs SmolLM2 (30 blocks) through it, phase by phase:
- first_client: the DHT peer, a public server for 0:15 and a server for 15:30 behind a cone NAT; a public
  client launched the moment that server logs "Serving blocks"; seconds from that line to the client's
  first token. Then the same with the server behind a symmetric NAT (no hole punching: relays only).
- home_chain: servers for 0:15 and 15:30 behind two routers (push through relays), clients behind a third,
  one after the other (the first once the servers are up): their tokens against transformers', seconds
  from each one's launch to its first token, the last one's decode rate against an all-public chain's
  (run first), and which of its hops ended up direct (hole punching).
- dht_gone: the DHT peer killed; a server behind a cone NAT then started with the public server as its only
  initial peer: seconds from its start, and from its "Serving blocks", to its line naming the relay.
- only_relay_dies: that server, holding one relay, keeps a client's session (paused) open while a second
  public server joins; the first is killed once the server holds the second too (and the client has read
  the records again), or 25 s after the join: seconds from the kill to the server's line naming the
  second relay (reachable all along when it held it before); whether the session then ended with the
  tokens of transformers.

    sudo python -m bench.wan.nat [--new-tokens 24] [--delay-ms 25]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.env import CHILD, ROOT, parser
from bench.lib.stamp import report
from corolla.launch.local import READY_SERVER, PeerProcess
from corolla.models.source import resolve_model
from corolla.swarm.p2p.addresses import peer_args
from tests.nat_harness import NatHarness

CLIENT = ROOT / "tests" / "nat_client.py"
PROMPT = "The capital of France is"
READY_DHT = re.compile(r"--initial-peers (/ip4/11\.79\.0\.10/\S+)")
SERVING = re.compile(r"Serving blocks")
RELAYED = re.compile(r"reachable through (\d) relay\(s\) \(([^)]*)\)")
PORT = 31340  # every public server's, each on a host of its own
CLIENT_REFRESH = 11.0  # seconds for a client to read the records again (ClientConfig.refresh_period, 10 s)


class Bench:
    def __init__(self, net: NatHarness, model: Path, args: argparse.Namespace, logs: Path):
        self.net, self.model, self.args, self.logs = net, model, args, logs
        self.env = {**os.environ, **CHILD}
        self.peers: list[PeerProcess] = []
        self.homes = 0
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.ids = AutoTokenizer.from_pretrained(model)(PROMPT).input_ids
        reference = AutoModelForCausalLM.from_pretrained(model)
        out = reference.generate(
            __import__("torch").tensor([self.ids]), max_new_tokens=args.new_tokens, do_sample=False
        )
        self.expected = out[0].tolist()

    def dht(self) -> tuple[PeerProcess, str]:
        args = ["dht", "--host", "0.0.0.0", "--port", "31337", "--no-nat-port-map"]
        dht = self.start("dht", args, self.net.PUBLIC)
        return dht, dht.wait_for(READY_DHT, 120).group(1)

    def server(
        self, name: str, blocks: str, peers: list[str], place: str, index: int, prefix: str | None = None
    ) -> PeerProcess:
        """`place`: public (a host of its own), cone or symmetric (behind a router of its own)."""
        if place == "public":
            namespace, listen = self.net.public_host(index), ["--host", "0.0.0.0", "--port", str(PORT)]
        else:
            self.homes += 1
            namespace = self.net.home(10 + self.homes, symmetric=place == "symmetric")
            listen = ["--host", "0.0.0.0"]
        args = [
            "server",
            str(self.model),
            "--blocks",
            blocks,
            *listen,
            "--no-nat-port-map",
            "--num-threads",
            "1",
        ]
        args += ["--dht-prefix", prefix] if prefix else []
        server = self.start(name, [*args, *peer_args(peers)], namespace)
        server.started_at = time.time()
        return server

    def start(self, name: str, args: list[str], namespace: str) -> PeerProcess:
        peer = PeerProcess(name, args, self.logs / f"{name}.log", self.env, netns=namespace)
        self.peers.append(peer)
        return peer

    def client(self, namespace: str, peers: list[str], extra: dict | None = None) -> subprocess.Popen:
        """tests/nat_client.py in `namespace`; `extra`: its environment's settings (a pause, a prefix)."""
        env = {**self.env, **(extra or {})}
        command = [sys.executable, str(CLIENT), str(self.model), "0.0.0.0", json.dumps(self.ids)]
        command += [str(self.args.new_tokens), *peers]
        log = (self.logs / f"client-{time.time():.0f}.log").open("w")
        return subprocess.Popen(
            [*self.net.exec(namespace), *command], stdout=subprocess.PIPE, stderr=log, text=True, env=env
        )

    def result(self, client: subprocess.Popen) -> dict:
        out, _ = client.communicate(timeout=600)
        if client.returncode != 0:
            raise RuntimeError(f"a client failed (logs in {self.logs})")
        return json.loads(out.strip().splitlines()[-1])

    def stop(self, *peers: PeerProcess) -> None:
        for peer in peers:
            peer.stop(timeout=15)


def seen_at(peer: PeerProcess, pattern: re.Pattern, timeout: float) -> float:
    """Wall-clock time at which `peer` logged `pattern` (to within the 50 ms this polls at)."""
    peer.wait_for(pattern, timeout)
    return time.time()


def first_client(bench: Bench, dht_address: str, public: PeerProcess) -> dict:
    measured = {}
    for place in ("cone", "symmetric"):
        home = bench.server(f"{place}-15:30", "15:30", [dht_address], place, 0)
        serving = seen_at(home, SERVING, 300)
        client = bench.client(bench.net.PUBLIC, [dht_address])
        result = bench.result(client)
        measured[place] = {
            "serving_to_first_token_s": round(result["first_token_at"] - serving, 2),
            "client_launch_to_first_token_s": round(result["first_token_at"] - result["launched_at"], 2),
            "server_start_to_serving_s": round(serving - home.started_at, 2),
            "relays": int(home.wait_for(RELAYED, 30).group(1)),
            "tokens_equal": result["tokens"] == bench.expected,
        }
        bench.stop(home)
    return measured


def chain(bench: Bench, dht_address: str, places: tuple[str, str], index: int) -> dict:
    """Two servers (a model of their own: a DHT prefix no other server uses) and a client."""
    prefix = f"chain-{index}"
    servers = [
        bench.server(f"{places[0]}-0:15-{index}", "0:15", [dht_address], places[0], index, prefix),
        bench.server(f"{places[1]}-15:30-{index}", "15:30", [dht_address], places[1], index + 1, prefix),
    ]
    for server in servers:
        server.wait_for(READY_SERVER, 300)
    where = bench.net.PUBLIC if places[0] == "public" else bench.net.home(30 + index, symmetric=False)
    prefixed = {"NAT_CLIENT_DHT_PREFIX": prefix}
    results = [bench.result(bench.client(where, [dht_address], prefixed)) for _ in range(3)]
    last = results[-1]  # its decode is the one reported
    ids = [server.wait_for(re.compile(r"peer_id=(\S+)"), 1).group(1) for server in servers]
    bench.stop(*servers)
    return {
        # the first client to reach the servers once they are up, then two more (each a process of its own)
        "client_launch_to_first_token_s": [round(r["first_token_at"] - r["launched_at"], 2) for r in results],
        "decode_tokens_per_s": round(last["decode_tokens_per_s"], 2),
        "direct_hops": sum(
            any("/p2p-circuit" not in a for a in last["connections"].get(peer, [])) for peer in ids
        ),
        "tokens_equal": all(result["tokens"] == bench.expected for result in results),
    }


def dht_gone(bench: Bench, dht: PeerProcess, public: PeerProcess) -> tuple[dict, PeerProcess, str]:
    dht.kill_group()
    public_id = public.wait_for(re.compile(r"peer_id=(\S+)"), 1).group(1)
    public_address = f"/ip4/11.79.0.21/tcp/{PORT}/p2p/{public_id}"
    late = bench.server("late-15:30", "15:30", [public_address], "cone", 0)
    serving = seen_at(late, SERVING, 300)
    relayed = seen_at(late, RELAYED, 60)
    return (
        {
            "server_start_to_reservation_s": round(relayed - late.started_at, 2),
            "serving_to_reservation_s": round(relayed - serving, 2),
            "relay_is_the_public_server": late.wait_for(RELAYED, 1).group(2) == public_id,
        },
        late,
        public_address,
    )


def only_relay_dies(bench: Bench, late: PeerProcess, public: PeerProcess, public_address: str) -> dict:
    resume = bench.logs / "resume"
    pause = {"NAT_CLIENT_PAUSE_AT": str(bench.args.new_tokens // 2), "NAT_CLIENT_RESUME": str(resume)}
    client = bench.client(bench.net.home(40, symmetric=False), [public_address], pause)
    if client.stdout.readline().strip() != "paused":
        raise RuntimeError(f"the paused client failed (logs in {bench.logs})")
    second = bench.server("second-0:15", "0:15", [public_address], "public", 2)
    second.wait_for(READY_SERVER, 300)
    second_id = second.wait_for(re.compile(r"peer_id=(\S+)"), 1).group(1)
    try:  # the server behind NAT looks for more relays every 10 s; the kill comes at most 25 s after the join
        held_before = bool(
            late.wait_for(re.compile(rf"reachable through 2 relay\(s\) \([^)]*{second_id}"), 25)
        )
        time.sleep(CLIENT_REFRESH)  # the client's view has the path through the second relay
    except Exception:
        held_before = False
    killed = time.time()
    public.kill_group()
    moved = seen_at(late, re.compile(rf"Relays changed \(gone: [^)]*\)\. Behind NAT, [^\n]*{second_id}"), 120)
    resume.touch()
    result = bench.result(client)
    return {
        "second_relay_held_before_the_kill": held_before,
        "kill_to_line_naming_the_second_relay_s": round(moved - killed, 2),
        "tokens_equal": result["tokens"] == bench.expected,
    }


def main() -> None:
    flags = parser(__doc__)
    flags.add_argument("--new-tokens", type=int, default=24)
    flags.add_argument("--delay-ms", type=int, default=25, help="one way, per bridge crossing")
    flags.add_argument("--chain-only", action="store_true", help="the first two phases only")
    args = flags.parse_args()
    if NatHarness.available() is not None:
        sys.exit(NatHarness.available())
    model = resolve_model("smollm2").path
    logs = Path(tempfile.mkdtemp(prefix="corolla-nat-"))
    started = time.perf_counter()
    with NatHarness(args.delay_ms) as net:
        bench = Bench(net, model, args, logs)
        try:
            dht, address = bench.dht()
            public = bench.server("public-0:15", "0:15", [address], "public", 1)
            public.wait_for(READY_SERVER, 300)
            result = {"first_client": first_client(bench, address, public)}
            baseline = chain(bench, address, ("public", "public"), 3)
            home = chain(bench, address, ("cone", "cone"), 5)
            home["decode_vs_all_public"] = round(
                home["decode_tokens_per_s"] / baseline["decode_tokens_per_s"], 2
            )
            if args.chain_only:
                result["home_chain"] = {"all_public": baseline, "behind_routers": home}
                return report(__file__, result)
            result["home_chain"] = {"all_public": baseline, "behind_routers": home}
            result["dht_gone"], late, public_address = dht_gone(bench, dht, public)
            result["only_relay_dies"] = only_relay_dies(bench, late, public, public_address)
        finally:
            for peer in reversed(bench.peers):
                peer.stop(timeout=10)
    result["config"] = {
        "model": "SmolLM2-135M-Instruct (fp32), 30 blocks",
        "new_tokens": args.new_tokens,
        "round_trip_ms": 2 * args.delay_ms,
        "public_peers": "corolla dht (no --public), public servers as each phase says",
        "logs": str(logs),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    report(__file__, result)


if __name__ == "__main__":
    main()
