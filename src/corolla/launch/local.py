"""A whole swarm on 127.0.0.1 in child processes: one DHT peer, N servers and optionally API servers
(demo, tests, benchmarks).

Every child runs the `corolla ...` command line (forked from a process that has imported corolla already,
see launch/forked.py; a fresh process on a machine with a CUDA GPU) in its own process group with NAT port
mapping off, writes its logs to a file in the work folder, and reports readiness with one line on stdout.
Stopping sends SIGTERM (servers announce OFFLINE and exit), then SIGKILL to whatever is left of each
process group, so the DHT child processes and libp2p daemons of every peer go too.
Only processes started here are signalled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from corolla.config import ClientConfig, SwarmConfig
from corolla.errors import CorollaError
from corolla.launch.forked import ForkedPeer, fork_peer
from corolla.swarm.p2p.addresses import peer_args

logger = logging.getLogger(__name__)

READY_DHT = re.compile(r"--initial-peers (/ip4/127\.0\.0\.1/\S+)")
READY_SERVER = re.compile(r"corolla server ready: peer_id=(\S+) blocks=(\d+):(\d+)")


class PeerProcess:
    """One child process (a DHT peer or a server) and its log file."""

    def __init__(
        self, name: str, args: Sequence[str], log_path: Path, env: dict[str, str], netns: str | None = None
    ):
        """The peer is forked from a process that has imported corolla already (launch/forked.py; a fresh
        process on a machine with a CUDA GPU), in network namespace `netns` if given (an emulated host)."""
        self.name = name
        self.log_path = log_path
        self.args = [sys.executable, "-m", "corolla", *args]
        self.popen: subprocess.Popen | ForkedPeer = fork_peer(args, log_path, env, netns=netns)
        self.pid = self.popen.pid
        self.peer_id: str | None = None
        self.blocks: tuple[int, int] | None = None
        self.url: str | None = None  # an HTTP server's address

    def wait_for(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = pattern.search(self.log())
            if match:
                return match
            if self.popen.poll() is not None:
                raise CorollaError(
                    f"{self.name} exited with code {self.popen.returncode} before it was ready:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.1)
        raise CorollaError(f"{self.name} was not ready within {timeout:.0f}s:\n{self.log_tail()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, wait, then SIGKILL the whole process group (the peer's DHT process and daemon too)."""
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0fs; killing it", self.name, timeout)
        self.kill_group()

    def signal_group(self, sig: int) -> None:
        """Signal its whole process group (the peer, its DHT process and daemon), as when its machine
        freezes (SIGSTOP) or wakes (SIGCONT)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def kill_group(self) -> None:
        if isinstance(self.popen, ForkedPeer):
            self.popen.kill_group()
        else:
            self.signal_group(signal.SIGKILL)  # its own group (start_new_session)
        self.popen.wait()


class LocalSwarm:
    def __init__(
        self,
        model: str,
        spans: Sequence[tuple[int, int]],
        *,
        dht_prefix: str | None = None,
        workdir: str | Path | None = None,
        num_threads: int = 1,
        server_args: Sequence[str] = (),
        start_timeout: float = 180.0,
        dht_args: Sequence[str] = (),
    ):
        """A swarm of `spans` servers of `model` with a DHT peer of its own, or, if `initial_peers` is set
        before it starts, joining the peer there (one serving other models too: none is started then)."""
        self.model = model
        self.spans = list(spans)
        self.dht_prefix = dht_prefix
        self.num_threads = num_threads
        self.server_args = list(server_args)
        self.start_timeout = start_timeout
        self.dht_args = list(dht_args)  # e.g. a private swarm's --identity and --allowed-peers
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="corolla-swarm-")
        self.workdir = Path(workdir or self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.dht: PeerProcess | None = None
        self.servers: list[PeerProcess] = []
        self.apis: list[PeerProcess] = []
        self._started = 0
        self.initial_peers: list[str] = []
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(num_threads),
            "TOKENIZERS_PARALLELISM": "false",
        }

    def start(self) -> LocalSwarm:
        try:
            if not self.initial_peers:
                self.dht = PeerProcess(
                    "dht",
                    ["dht", "--host", "127.0.0.1", "--no-nat-port-map", *self.dht_args],
                    self.workdir / "dht.log",
                    self.env,
                )
                self.initial_peers = [self.dht.wait_for(READY_DHT, self.start_timeout).group(1)]
            started = [self.add_server(span, wait=False) for span in self.spans]
            for server in started:
                self.wait_ready(server)
        except BaseException:
            self.stop()
            raise
        return self

    def add_server(
        self, blocks: tuple[int, int] | None, extra_args: Sequence[str] = (), wait: bool = True
    ) -> PeerProcess:
        """Start a server for `blocks` (None: it places itself; its blocks are known once it is ready)."""
        index = self._started  # not len(servers): callers remove servers they kill, and logs must not clash
        self._started += 1
        placement = ["--blocks", f"{blocks[0]}:{blocks[1]}"] if blocks else []
        args = [
            "server",
            self.model,
            *placement,
            "--host",
            "127.0.0.1",
            "--no-nat-port-map",
            "--num-threads",
            str(self.num_threads),
            *peer_args(self.initial_peers),
            *self.server_args,
            *extra_args,
        ]
        if self.dht_prefix:
            args += ["--dht-prefix", self.dht_prefix]
        name = f"server {index} ({blocks[0]}:{blocks[1]})" if blocks else f"server {index} (self-placed)"
        server = PeerProcess(name, args, self.workdir / f"server{index}.log", self.env)
        self.servers.append(server)
        if wait:
            self.wait_ready(server)
        return server

    def add_api(self, port: int | None = None, extra_args: Sequence[str] = ()) -> PeerProcess:
        """Start `corolla api` for this swarm's model on 127.0.0.1; ready once /health answers.

        Its URL is `process.url` (e.g. http://127.0.0.1:PORT); it is stopped with the swarm.
        """
        port = port or free_port()
        args = [
            "api",
            self.model,
            "--port",
            str(port),
            "--no-nat-port-map",
            *peer_args(self.initial_peers),
        ]
        if self.dht_prefix:
            args += ["--dht-prefix", self.dht_prefix]
        api = PeerProcess(f"api :{port}", [*args, *extra_args], self.workdir / f"api{port}.log", self.env)
        api.url = f"http://127.0.0.1:{port}"
        self.apis.append(api)
        deadline = time.monotonic() + self.start_timeout
        while not answers_http(f"{api.url}/health"):
            if not api.alive or time.monotonic() > deadline:
                raise CorollaError(f"{api.name} did not start:\n{api.log_tail()}")
            time.sleep(0.2)
        return api

    def wait_ready(self, server: PeerProcess) -> None:
        """Wait until a server started with wait=False is ready (its peer id and blocks are known then)."""
        match = server.wait_for(READY_SERVER, self.start_timeout)
        server.peer_id = match.group(1)
        server.blocks = (int(match.group(2)), int(match.group(3)))

    def stop(self) -> None:
        """Stop every peer, even if stopping one of them fails (that error is raised once all are done)."""
        peers = [*self.apis, *self.servers, *([self.dht] if self.dht is not None else [])]
        for server in self.servers:
            server.signal(signal.SIGTERM)  # all at once: their shutdowns overlap
        with contextlib.ExitStack() as stack:
            stack.callback(self._cleanup)  # runs last
            for peer in reversed(peers):  # the stack stops them in order: APIs, servers, the DHT
                stack.callback(peer.stop)

    def _cleanup(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def client_config(self, **overrides: Any) -> ClientConfig:
        """A client configuration that joins this swarm over loopback (no NAT port mapping)."""
        return client_config("127.0.0.1", self.initial_peers, **overrides)

    def __enter__(self) -> LocalSwarm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def client_config(host: str, peers: Sequence[str], **overrides: Any) -> ClientConfig:
    """A client configuration that joins the swarm of `peers` from `host` (no NAT port mapping, client
    mode), as tests, benchmarks and local swarms start their clients; `overrides`: ClientConfig fields."""
    swarm = SwarmConfig(initial_peers=tuple(peers), host=host, nat_port_map=False, client_mode=True)
    return ClientConfig(swarm=swarm, **overrides)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers_http(url: str) -> bool:
    """Whether `url` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def even_spans(num_blocks: int, num_servers: int) -> list[tuple[int, int]]:
    """Split blocks into `num_servers` contiguous spans of (nearly) equal length."""
    bounds = [round(i * num_blocks / num_servers) for i in range(num_servers + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(num_servers)]
