"""An emulated internet for benchmarks: a swarm in network namespaces, a client run inside one of them.

`WanSwarm` builds HOSTS hosts with `../shared/tools/wan/netsim.sh` (namespaces joined by a bridge, every
packet between hosts delayed, optionally each host's upload capped; no namespace has a route out), runs
the DHT peer in host 0 and one SmolLM2 server per span in the next hosts, and runs client code (a script
given `--client` arguments) in the last host, returning the JSON it prints last. Needs root and iptables
(`apt-get install iptables`); removes everything it created on exit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

from bench.lib.env import CHILD, ROOT, module_command

NETSIM = ROOT.parent / "shared" / "tools" / "wan" / "netsim.sh"
HOSTS = 5
SPANS = [(0, 10), (10, 20), (20, 30)]


def address(host: int) -> str:
    return f"10.77.0.{10 + host}"


def namespace(host: int) -> str:
    return f"wan-h{host}"


def netns(host: int) -> list[str]:
    return ["ip", "netns", "exec", namespace(host)]


def netsim(*args: str) -> None:
    subprocess.run(["bash", str(NETSIM), *args], check=True, capture_output=True)


class WanSwarm:
    """The DHT in host 0, a server per span in hosts 1.., the client in host HOSTS - 1."""

    def __init__(self, delay_ms: float, rate: str | None = None, server_args: tuple[str, ...] = ()):
        self.delay_ms = delay_ms
        self.rate = rate
        self.server_args = server_args
        self.client_host = HOSTS - 1
        self.peers: list = []
        self.initial_peers: list[str] = []

    def __enter__(self) -> WanSwarm:
        from corolla.launch.local import READY_SERVER, PeerProcess
        from corolla.models.source import resolve_model
        from corolla.swarm.p2p.addresses import peer_args

        resolve_model("smollm2")  # converted once, before any server needs it
        netsim("up", str(HOSTS), str(self.delay_ms), *([self.rate] if self.rate else []))
        workdir = Path(tempfile.mkdtemp(prefix="corolla-wan-"))
        env = {**os.environ, **CHILD}
        try:
            dht_args = ["dht", "--host", address(0), "--no-nat-port-map"]
            dht = PeerProcess("dht", dht_args, workdir / "dht.log", env, netns=namespace(0))
            self.peers.append(dht)
            found = dht.wait_for(re.compile(r"--initial-peers (/ip4/10\.77\.0\.10/\S+)"), 120)
            self.initial_peers = [found.group(1)]
            for host, (start, end) in enumerate(SPANS, start=1):
                args = ["server", "smollm2", "--blocks", f"{start}:{end}", "--host", address(host),
                        "--no-nat-port-map", "--num-threads", "1", *self.server_args,
                        *peer_args(self.initial_peers)]  # fmt: skip
                log = workdir / f"server{host}.log"
                self.peers.append(PeerProcess(f"server {host}", args, log, env, netns=namespace(host)))
            for server in self.peers[1:]:
                server.wait_for(READY_SERVER, 300)
        except BaseException:
            self.__exit__()
            raise
        return self

    def set(self, delay_ms: float, rate: str | None = None) -> None:
        """Change the delay (and upload cap) while everything runs."""
        netsim("set", str(delay_ms), *([rate] if rate else []))

    def run_client(self, module: str, args: list[str], timeout: float = 3600) -> dict:
        """Run `python -m module --client INITIAL_PEER ... ARGS` inside the client's host; its last line of
        JSON."""
        command = [*netns(self.client_host), *module_command(module), "--client", *self.initial_peers, *args]
        env = {**os.environ, **CHILD}
        out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"the client failed:\n{out.stderr[-4000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def __exit__(self, *exc: object) -> None:
        for peer in reversed(self.peers):
            peer.stop(timeout=10)
        self.peers = []
        subprocess.run(["bash", str(NETSIM), "down"], check=False, capture_output=True)
