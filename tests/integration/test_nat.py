"""Servers behind emulated home routers (tests/nat_harness.py): reachable through relays, their tokens
those of transformers on the same checkpoint, also when routers forget idle flows, relays cut connections
at their time limit, and relays die.

Four `corolla dht --public` peers on the public side are the relays (libp2p takes a reservation at once
only when it knows four; with fewer it waits 3 minutes), each ending a relayed connection after 30 s (as
does the public server, which libp2p makes a relay too once its AutoNAT finds it public). A
chain of three servers: a public one (its initial peers dial it back: served directly), one behind a
symmetric NAT (a new port per flow: no hole punching, no dialing in; started with `--behind-nat`) and one
behind a cone NAT (nobody can dial it back: it goes behind relays by itself), push on (the default: a
server sends its outputs to the next, through a relay to a server behind NAT); the client reaches them
only through relays: a public client, and one behind a router of its own. One swarm for the module's
tests.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import torch

from corolla.launch.local import READY_SERVER, PeerProcess
from corolla.swarm.addresses import peer_args
from nat_harness import PUBLIC_IP, NatHarness, relay_ip
from swarm_helpers import reference_generate
from tiny_models import load_reference

pytestmark = pytest.mark.skipif(NatHarness.available() is not None, reason=str(NatHarness.available()))

CLIENT = Path(__file__).resolve().parents[1] / "nat_client.py"
RELAYED = re.compile(r"Behind NAT, reachable through (\d+) relay\(s\) \(([^)]*)\)")
DIALED_BACK = re.compile(r"peer\(s\) dialed this one back at /ip4/11\.79\.0\.10/tcp/")
NOT_DIALED_BACK = re.compile(r"Not reachable directly: \d peer\(s\) could not dial this one back at /ip4/11")
RELAYS_CHANGED = re.compile(r"Relays changed \(gone: .*\); reachable through")
PEER_ID = re.compile(r"peer_id=(\S+)")
STRANDED = re.compile(r"WARN corolla.server.server: (.*)")
ENV = {
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
NEW_TOKENS = 12
PUBLIC_PORT = 31340
RELAY_PORT = 31330  # the first of the 4 relays'
CONNTRACK_TIMEOUT = 5  # seconds a router keeps an idle flow's mapping in the connection-tracking test
RELAY_TIME_LIMIT = 30  # seconds the relays let a relayed connection last (libp2p daemon's default: 30 min)
RELAY_LIMIT = ["--relay-time-limit", str(RELAY_TIME_LIMIT)]


def generate(namespace: list[str], host: str, args: list[str], env: dict) -> list[int]:
    """Greedy tokens from tests/nat_client.py run in `namespace`, listening on `host`."""
    return run_client(namespace, host, args, env)["tokens"]


def run_client(namespace: list[str], host: str, args: list[str], env: dict) -> dict:
    """What tests/nat_client.py run in `namespace`, listening on `host`, prints."""
    out = subprocess.run(
        client_command(namespace, host, args), capture_output=True, text=True, env=env, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def direct(connections: dict[str, list[str]], server: PeerProcess) -> bool:
    """Whether the client had a direct connection (not only a relayed one) to `server` at its end."""
    peer_id = server.wait_for(PEER_ID, 1).group(1)
    return any("/p2p-circuit" not in address for address in connections.get(peer_id, []))


def client_command(namespace: list[str], host: str, args: list[str]) -> list[str]:
    model, prompt, new_tokens, *peers = args
    return [*namespace, sys.executable, str(CLIENT), model, host, prompt, new_tokens, *peers]


def generate_with_a_pause(
    swarm: NatSwarm, pause_at: int, during: Callable[[], None], push: bool = True
) -> dict:
    """What tests/nat_client.py says of a client behind a cone NAT whose session stays open, idle, while
    `during` runs after `pause_at` tokens: its tokens, its connections at the end. `push`: servers push
    their outputs to the next (else each step goes to each server from the client)."""
    resume = swarm.logs / f"resume-{pause_at}"
    env = {**swarm.env, "NAT_CLIENT_PAUSE_AT": str(pause_at), "NAT_CLIENT_RESUME": str(resume)}
    env["NAT_CLIENT_PUSH"] = "1" if push else "0"
    command = client_command(swarm.net.exec(swarm.client_home), "0.0.0.0", swarm.args)
    log = swarm.logs / f"client-paused-at-{pause_at}.log"
    with log.open("w") as stderr:
        client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        try:
            assert client.stdout.readline().strip() == "paused", log.read_text()[-3000:]
            during()
            resume.touch()
            out, _ = client.communicate(timeout=180)
        finally:
            client.kill()
            client.wait()
    assert client.returncode == 0, log.read_text()[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def reached(net: NatHarness, relays: list[str], env: dict) -> set[tuple[int, str]]:
    """(first block, how it is reached) of every server, as `corolla status --json` shows them."""
    status = [*net.exec(net.PUBLIC), sys.executable, "-m", "corolla", "status", "--json"]
    status += ["--host", PUBLIC_IP, "--no-nat-port-map", *peer_args(relays)]
    out = subprocess.run(status, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    (swarm,) = json.loads(out.stdout)  # one model
    return {(server["start"], server["reachability"]) for server in swarm["servers"]}


def start_servers(net: NatHarness, path: Path, relays: list[str], env: dict, logs: Path) -> list[PeerProcess]:
    """Blocks 0:2 on a public server, 2:4 behind a symmetric NAT, 4:6 behind a cone NAT."""
    common = ["--no-nat-port-map", "--num-threads", "1", *peer_args(relays)]
    places = [
        # dialed back; libp2p's AutoNAT later finds it public, and it relays too
        ("public", "0:2", net.PUBLIC, ["--host", PUBLIC_IP, "--port", str(PUBLIC_PORT), *RELAY_LIMIT]),
        ("symmetric", "2:4", net.home(1, symmetric=True), ["--host", "0.0.0.0", "--behind-nat"]),
        ("cone", "4:6", net.home(3, symmetric=False), ["--host", "0.0.0.0"]),  # found behind NAT
    ]
    servers = []
    for name, blocks, namespace, where in places:
        args = ["server", str(path), "--blocks", blocks, *where, *common]
        servers.append(PeerProcess(name, args, logs / f"{name}.log", env, net.exec(namespace)))
    return servers


def start_stranded_server(
    net: NatHarness, path: Path, public: PeerProcess, env: dict, logs: Path
) -> PeerProcess:
    """A server behind a router that lets nothing in and keeps it from the relays, whose only initial peer
    relays for nobody (the public server: found reachable, not started with --public), of a model of its
    own (no client tries it)."""
    peer_id = public.wait_for(PEER_ID, 180).group(1)
    only_peer = f"/ip4/{PUBLIC_IP}/tcp/{PUBLIC_PORT}/p2p/{peer_id}"
    args = ["server", str(path), "--blocks", "0:2", "--dht-prefix", "stranded", "--host", "0.0.0.0"]
    args += ["--no-nat-port-map", "--num-threads", "1", "--initial-peers", only_peer]
    home = net.home(4, symmetric=False)
    for index in range(4):
        net.block(home, relay_ip(index), (RELAY_PORT, RELAY_PORT + 3))
    return PeerProcess("stranded", args, logs / "stranded.log", env, net.exec(home))


@dataclass
class NatSwarm:
    net: NatHarness
    relays: list[PeerProcess]
    relay_addresses: list[str]
    servers: list[PeerProcess]
    client_home: str
    args: list[str]  # the client's: model, prompt, new tokens, initial peers
    expected: list[int]
    env: dict
    logs: Path


@pytest.fixture(scope="module")
def swarm(tiny_models, tmp_path_factory) -> Iterator[NatSwarm]:
    path = tiny_models["llama"]
    logs = tmp_path_factory.mktemp("nat")
    prompt = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(5))
    expected = reference_generate(load_reference(path), prompt, max_new_tokens=NEW_TOKENS)[0].tolist()
    env = {**os.environ, **ENV}
    relays: list[PeerProcess] = []
    servers: list[PeerProcess] = []
    with NatHarness() as net:
        try:
            addresses = net.start_relays(logs, env, relays, RELAY_PORT, RELAY_LIMIT)
            servers = start_servers(net, path, addresses, env, logs)
            servers.append(start_stranded_server(net, path, servers[0], env, logs))
            for server in servers[:3]:  # the stranded one is checked by its test
                server.wait_for(READY_SERVER, 180)
            args = [str(path), json.dumps(prompt[0].tolist()), str(NEW_TOKENS), *addresses]
            home = net.home(2, symmetric=False)  # the client's own router
            yield NatSwarm(net, relays, addresses, servers, home, args, expected, env, logs)
        finally:
            for peer in reversed(relays + servers):
                peer.stop(timeout=10)


def test_servers_behind_nat_serve_through_relays(swarm):
    """A chain of three servers, two behind NAT (one symmetric, one cone), with push between them: each
    server found out how it is reached at start; a public client and one behind a router of its own (it
    needs nothing: it dials out) get the reference tokens. The public client reaches the server behind the
    cone NAT through a relay, then directly (libp2p's hole punching: that server dials out to it), the one
    behind the symmetric NAT only through relays."""
    public, symmetric, cone, _ = swarm.servers
    assert public.wait_for(DIALED_BACK, 1)  # said at start, before ready
    assert cone.wait_for(NOT_DIALED_BACK, 1)
    for server in (symmetric, cone):
        assert int(server.wait_for(RELAYED, 10).group(1)) >= 1
    public_client = run_client(swarm.net.exec(swarm.net.PUBLIC), PUBLIC_IP, swarm.args, swarm.env)
    assert public_client["tokens"] == swarm.expected
    assert direct(public_client["connections"], public) and direct(public_client["connections"], cone)
    assert not direct(public_client["connections"], symmetric)
    assert reached(swarm.net, swarm.relay_addresses, swarm.env) == {
        (0, "direct"),
        (2, "relayed"),
        (4, "relayed"),
    }
    assert generate(swarm.net.exec(swarm.client_home), "0.0.0.0", swarm.args, swarm.env) == swarm.expected


def test_a_session_outlives_the_routers_connection_tracking(swarm):
    """The client's router forgets a flow idle for 5 s (home routers forget in minutes; Linux's default is
    5 days; libp2p's keepalive comes every 30 s): a session left idle for 12.5 s (under the relays' time
    limit) continues with the same tokens (a cone router maps the flow to the same port when the client
    sends again)."""
    swarm.net.forget_idle_flows(swarm.client_home, CONNTRACK_TIMEOUT)
    try:
        tokens = generate_with_a_pause(swarm, 4, lambda: time.sleep(2.5 * CONNTRACK_TIMEOUT))["tokens"]
    finally:
        swarm.net.forget_idle_flows(swarm.client_home)
    assert tokens == swarm.expected


def test_a_session_outlives_the_relays_time_limit(swarm):
    """Every relay ends a connection it relays after 30 s (`--relay-time-limit`). The client behind a cone
    NAT reaches the server behind the symmetric NAT only through a relay (neither can dial the other); without
    push, its every step goes there. Left idle past the limit, its session continues with the same tokens.
    Whether a failover shows in its log varies from run to run (isolated, this test sees the relayed stream
    cut and the session replayed on the same server; after the module's earlier tests it often sees no cut
    at all), so only the tokens and the relayed path are asserted; a cut's recovery is asserted in
    tests/unit/client/test_chain.py and measured in bench/nat.py."""
    symmetric = swarm.servers[1]
    past_the_limit = partial(time.sleep, RELAY_TIME_LIMIT + 5)
    result = generate_with_a_pause(swarm, 5, past_the_limit, push=False)
    assert result["tokens"] == swarm.expected
    assert not direct(result["connections"], symmetric)


def test_a_session_outlives_the_relays_it_goes_through(swarm):
    """Every relay the server behind the symmetric NAT holds a reservation on (every path to it: nobody can
    dial it, or punch a hole to it) is killed mid-generation: the session fails over to the same server
    once it has taken reservations on the relays left, with the same tokens."""
    symmetric = swarm.servers[1]
    used = set(symmetric.wait_for(RELAYED, 1).group(2).split(", "))
    doomed = [
        relay
        for relay, address in zip(swarm.relays, swarm.relay_addresses, strict=True)
        if address.rsplit("/p2p/", 1)[1] in used
    ]
    assert 1 <= len(doomed) < len(swarm.relays)

    def kill_relays() -> None:
        for relay in doomed:
            relay.kill_group()  # kill -9, its DHT process and daemon too: as if its machine died

    assert generate_with_a_pause(swarm, 6, kill_relays)["tokens"] == swarm.expected
    assert "failed (server" in (swarm.logs / "client-paused-at-6.log").read_text()  # the path broke
    # the server sees its relays gone at its next look (every 5 s), maybe after the session went on
    assert symmetric.wait_for(RELAYS_CHANGED, 20)


def test_a_server_nobody_can_reach_says_so_in_one_line(swarm):
    """Behind a router that lets nothing in, in a swarm where nobody relays: one warning at start."""
    stranded = swarm.servers[3]
    assert stranded.wait_for(NOT_DIALED_BACK, 1)
    line = stranded.wait_for(STRANDED, 60).group(0)
    assert "Behind NAT and no relay took a reservation within 30s: no client can reach this server" in line
    assert "--initial-peers that run with --public" in line and "forward a TCP port" in line
