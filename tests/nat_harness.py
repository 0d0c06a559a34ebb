"""Home routers on one machine: network namespaces joined by a bridge (the "internet"), and homes behind
routers that masquerade (NAT), as ../shared/docs/nat-harness.md describes. Needs root and iptables.

    with NatHarness() as net:
        net.exec(net.PUBLIC)          # ["ip", "netns", "exec", "cnt-pub"]: a public host, at PUBLIC_IP
        home = net.home(1, symmetric=True)   # a host behind its own router

Public hosts get addresses libp2p takes for public ones (it relays only through those), from a range no
namespace here has a route out of: nothing leaves the bridge. A symmetric router (`--random-fully`)
maps each flow to a new port, so nothing but a relay reaches the home; a cone router keeps ports.
Everything created is removed on exit, by name.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

PREFIX = "cnt"
PUBLIC_NET = "11.79.0"  # the bridge: public-looking, routed nowhere
PUBLIC_IP = f"{PUBLIC_NET}.10"
DELAYER = Path(__file__).resolve().parents[2] / "shared" / "tools" / "wan" / "delayer.py"
LINUX_TRACKING_TIMEOUT = 432000  # seconds an established TCP flow stays tracked
READY_RELAY = re.compile(r"--initial-peers (/ip4/11\.79\.0\.\d+/\S+)")  # what `corolla dht` prints
RELAY_HOSTS = 10  # relay i on public host 10 + i


def relay_ip(index: int) -> str:
    return f"{PUBLIC_NET}.{20 + RELAY_HOSTS + index}"


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


class NatHarness:
    PUBLIC = f"{PREFIX}-pub"

    def __init__(self, delay_ms: int = 0) -> None:
        """`delay_ms`: each packet crossing the bridge is held that long where it arrives (a public host, a
        router), by ../shared/tools/wan/delayer.py (this kernel has no netem): round trips of 2 x delay_ms
        between a public host and a home. Needs that tool when non-zero."""
        self.namespaces: list[str] = []
        self.homes: dict[str, str] = {}  # each home's namespace -> its router's
        self.delay_ms = delay_ms
        self.delayers: list[subprocess.Popen] = []
        self.folder = Path(tempfile.mkdtemp(prefix="corolla-nat-harness-"))

    @staticmethod
    def available() -> str | None:
        """None when this machine can build the harness, else why not."""
        import os

        if os.geteuid() != 0:
            return "the NAT harness needs root (network namespaces, iptables)"
        if shutil.which("iptables") is None:
            return "the NAT harness needs iptables (apt-get install iptables)"
        return None

    def exec(self, namespace: str) -> list[str]:
        return ["ip", "netns", "exec", namespace]

    def __enter__(self) -> NatHarness:
        switch = self._namespace("sw")
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run(
            "ip", "-n", switch, "link", "set", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0"
        )
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        self._namespace("pub")
        self._plug(self.PUBLIC, "eth0", "vpub", f"{PUBLIC_IP}/24")
        return self

    def public_host(self, index: int) -> str:
        """Another public host, at 11.79.0.(20 + INDEX)."""
        namespace = self._namespace(f"p{index}")
        self._plug(namespace, "eth0", f"vp{index}", f"{PUBLIC_NET}.{20 + index}/24")
        return namespace

    def home(self, index: int, symmetric: bool) -> str:
        """A host at 10.89.INDEX.2 behind router INDEX (11.79.0.(100 + INDEX) on the bridge)."""
        router, home = self._namespace(f"r{index}"), self._namespace(f"h{index}")
        self._plug(router, "wan0", f"vr{index}", f"{PUBLIC_NET}.{100 + index}/24")
        lan = f"10.89.{index}"
        _run("ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", home)
        _run("ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan0")
        _run("ip", "-n", router, "link", "set", "lan0", "up")
        _run("ip", "-n", home, "addr", "add", f"{lan}.2/24", "dev", "eth0")
        _run("ip", "-n", home, "link", "set", "eth0", "up")
        _run("ip", "-n", home, "route", "add", "default", "via", f"{lan}.1")
        in_router = self.exec(router)
        _run(*in_router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        masquerade = ["-j", "MASQUERADE", *(["--random-fully"] if symmetric else [])]
        _run(
            *in_router,
            "iptables",
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-s",
            f"{lan}.0/24",
            "-o",
            "wan0",
            *masquerade,
        )
        _run(*in_router, "iptables", "-A", "FORWARD", "-i", "lan0", "-o", "wan0", "-j", "ACCEPT")
        established = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
        _run(*in_router, "iptables", "-A", "FORWARD", "-i", "wan0", "-o", "lan0", *established)
        _run(*in_router, "iptables", "-A", "FORWARD", "-i", "wan0", "-o", "lan0", "-j", "DROP")
        # a home router drops what nobody inside asked for (a reset would end a hole punch's first dial)
        _run(
            *in_router,
            "iptables",
            "-A",
            "INPUT",
            "-i",
            "wan0",
            "-m",
            "conntrack",
            "--ctstate",
            "NEW",
            "-j",
            "DROP",
        )
        self.homes[home] = router
        return home

    def block(self, home: str, host: str, ports: tuple[int, int]) -> None:
        """Make `home`'s router drop what its hosts send to `host` at ports first..last."""
        where = ["-d", host, "-p", "tcp", "--dport", f"{ports[0]}:{ports[1]}"]
        _run(*self.exec(self.homes[home]), "iptables", "-I", "FORWARD", "-i", "lan0", *where, "-j", "DROP")

    def forget_idle_flows(self, home: str, seconds: int = LINUX_TRACKING_TIMEOUT) -> None:
        """Make `home`'s router forget a TCP flow (its NAT mapping) idle for `seconds` (Linux's default:
        5 days; home routers: minutes). Flows seen again are tracked anew: a cone router maps them to the
        same port, a symmetric one to a new one."""
        timeout = f"net.netfilter.nf_conntrack_tcp_timeout_established={seconds}"
        _run(*self.exec(self.homes[home]), "sysctl", "-qw", timeout)

    def start_relays(
        self, logs: Path, env: dict, peers: list, first_port: int = 31330, options: Sequence[str] = ()
    ) -> list[str]:
        """4 `corolla dht --public` peers, each on a public host of its own at 11.79.0.(30 + i) (libp2p
        reserves at once only when it knows 4 relays, and trusts the address a peer sees for it only when
        peers at 4 different IPs see it), with `options` (relay limits); their addresses. The processes go
        to `peers` (the caller stops them)."""
        first = self._relay(0, [*options], first_port, logs, env, peers)
        address = first.wait_for(READY_RELAY, 60).group(1)
        bootstrap = [*options, "--initial-peers", address]
        others = [self._relay(index, bootstrap, first_port, logs, env, peers) for index in (1, 2, 3)]
        return [address, *(relay.wait_for(READY_RELAY, 60).group(1) for relay in others)]

    def _relay(self, index: int, options: list[str], first_port: int, logs: Path, env: dict, peers: list):
        from corolla.launch.local import PeerProcess

        host = self.public_host(RELAY_HOSTS + index)
        args = ["dht", "--host", relay_ip(index), "--port", str(first_port + index), "--no-nat-port-map"]
        log = logs / f"relay{index}.log"
        relay = PeerProcess(f"relay {index}", [*args, "--public", *options], log, env, netns=host)
        peers.append(relay)
        return relay

    def _namespace(self, name: str) -> str:
        namespace = f"{PREFIX}-{name}"
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)  # a leftover of a killed run
        _run("ip", "netns", "add", namespace)
        self.namespaces.append(namespace)
        _run("ip", "-n", namespace, "link", "set", "lo", "up")
        return namespace

    def _plug(self, namespace: str, device: str, port: str, address: str) -> None:
        """A leg of `namespace` on the bridge."""
        switch = f"{PREFIX}-sw"
        _run(
            "ip",
            "-n",
            switch,
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "name",
            device,
            "netns",
            namespace,
        )
        _run("ip", "-n", switch, "link", "set", port, "master", "br0")
        _run("ip", "-n", switch, "link", "set", port, "up")
        _run("ip", "-n", namespace, "addr", "add", address, "dev", device)
        _run("ip", "-n", namespace, "link", "set", device, "up")
        if self.delay_ms:
            self._delay(namespace, device)

    def _delay(self, namespace: str, device: str) -> None:
        """Packets arriving on `device` held delay_ms (an NFQUEUE rule and the wan tool's delayer)."""
        queue = ["-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass"]
        _run(*self.exec(namespace), "iptables", "-t", "mangle", "-A", "PREROUTING", "-i", device, *queue)
        (self.folder / "delay_ms").write_text(str(self.delay_ms))
        log = self.folder / f"delayer-{namespace}.log"
        command = [*self.exec(namespace), sys.executable, str(DELAYER), str(self.folder / "delay_ms"), "0"]
        with log.open("w") as out:
            self.delayers.append(subprocess.Popen(command, stdout=out, stderr=out, start_new_session=True))
        deadline = time.monotonic() + 10
        while "delayer:" not in log.read_text() and time.monotonic() < deadline:  # its queue is bound
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        for delayer in self.delayers:
            delayer.kill()
            delayer.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
        for namespace in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self.namespaces = []
