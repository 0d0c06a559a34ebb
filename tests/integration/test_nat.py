"""Servers behind emulated home routers (tests/nat_harness.py) in a swarm whose only public peer is started
as the README says, `corolla dht --host 0.0.0.0 --port PORT`, and whose servers are started plainly
(`corolla server MODEL --blocks A:B --initial-peers ADDR`): their tokens are those of transformers on the
same checkpoint, also when routers forget idle flows, relays cut connections at their time limit, and
relays die.

A chain of three servers: a public one (its initial peer dials it back: served directly, and it relays),
one behind a symmetric NAT (a new port per flow: no hole punching, no dialing in) and one behind a cone
NAT; both find out by themselves that nobody can dial them and hold reservations on the two relays there
are (the DHT peer and the public server), with push (a server sends its outputs to the next, through a
relay to a server behind NAT). Clients: a public one, and one behind a router of its own. The relays end
a relayed connection after 20 s. One swarm for the module's tests, in order: the DHT peer is killed by
the fourth, the public server by the fifth.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import torch

from corolla.launch.forked import fork_peer
from corolla.launch.local import READY_SERVER, PeerProcess
from corolla.swarm.p2p.addresses import peer_args
from nat_harness import PUBLIC_IP, NatHarness
from swarm_helpers import reference_generate, run_corolla
from tiny_models import load_reference

pytestmark = pytest.mark.skipif(NatHarness.available() is not None, reason=str(NatHarness.available()))

CLIENT = Path(__file__).resolve().parents[1] / "nat_client.py"
READY_DHT = re.compile(r"--initial-peers (/ip4/11\.79\.0\.10/\S+)")  # what `corolla dht` prints
RELAYS_OWN_LIMITS = re.compile(r"Relaying for peers behind NAT: each relayed connection at most 20 s")
RELAYED = re.compile(
    r"Behind NAT, reachable through (\d+) relay\(s\) \(([^)]*)\); each relayed connection 20 s"
)
TWO_RELAYS = re.compile(r"reachable through 2 relay\(s\) \(([^)]*)\)")
DIALED_BACK = re.compile(r"peer\(s\) dialed this one back at /ip4/11\.79\.0\.21/tcp/")
NOT_DIALED_BACK = re.compile(r"Not reachable directly: \d peer\(s\) could not dial this one back at /ip4/11")
PEER_ID = re.compile(r"peer_id=(\S+)")
ENV = {
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
NEW_TOKENS = 12
DHT_PORT = 31330
PUBLIC_PORT = 31340  # the public servers', each on a host of its own
CONNTRACK_TIMEOUT = 5  # seconds the client's router keeps an idle flow's mapping in the tracking test
SERVER_CONNTRACK_TIMEOUT = 15  # the symmetric server's router's (libp2p's keepalive comes every 30 s)
RELAY_TIME_LIMIT = 20  # seconds the relays let a relayed connection last (default: 30 min)
RELAY_LIMIT = ["--relay-time-limit", str(RELAY_TIME_LIMIT)]


@dataclass
class NatSwarm:
    net: NatHarness
    dht: PeerProcess
    servers: list[PeerProcess]  # public, symmetric, cone, then those the tests add
    initial_peer: str  # the DHT peer's address, then (once it is gone) the public server's
    client_home: str
    prompt: str
    path: Path
    expected: list[int]
    env: dict
    logs: Path

    @property
    def args(self) -> list[str]:
        """The client's: model, prompt, new tokens, initial peers."""
        return [str(self.path), self.prompt, str(NEW_TOKENS), self.initial_peer]


def run_client(namespace: str, host: str, args: list[str], env: dict, logs: Path) -> dict:
    """What tests/nat_client.py run in `namespace`, listening on `host`, prints."""
    client, out, err = start_client(namespace, host, args, env, logs)
    try:
        code = client.wait(180)
    finally:
        client.kill_group()
    assert code == 0, err.read_text(errors="replace")[-3000:]
    return json.loads(out.read_text().strip().splitlines()[-1])


def start_client(namespace: str, host: str, args: list[str], env: dict, logs: Path) -> tuple:
    """tests/nat_client.py forked into `namespace` (launch/forked.py): the process, and the files of its
    output (logs/client-N.out) and of its log (.err)."""
    model, prompt, new_tokens, *peers = args
    name = f"client-{len(list(logs.glob('client-*.out')))}"
    out, err = logs / f"{name}.out", logs / f"{name}.err"
    arguments = [model, host, prompt, new_tokens, *peers]
    return fork_peer(arguments, out, env, err, netns=namespace, script=CLIENT), out, err


def peer_id(peer: PeerProcess) -> str:
    return peer.wait_for(PEER_ID, 1).group(1)


def direct(connections: dict[str, list[str]], server: PeerProcess) -> bool:
    """Whether the client had a direct connection (not only a relayed one) to `server` at its end."""
    return any("/p2p-circuit" not in address for address in connections.get(peer_id(server), []))


def generate_with_a_pause(
    swarm: NatSwarm, pause_at: int, during: Callable[[], None], push: bool = True
) -> dict:
    """What tests/nat_client.py says of a client behind a cone NAT whose session stays open, idle, while
    `during` runs after `pause_at` tokens: its tokens, its connections at the end. `push`: servers push
    their outputs to the next (else each step goes to each server from the client)."""
    resume = swarm.logs / f"resume-{pause_at}"
    env = {**swarm.env, "NAT_CLIENT_PAUSE_AT": str(pause_at), "NAT_CLIENT_RESUME": str(resume)}
    env["NAT_CLIENT_PUSH"] = "1" if push else "0"
    client, out, err = start_client(swarm.client_home, "0.0.0.0", swarm.args, env, swarm.logs)
    try:
        deadline = time.monotonic() + 180
        while "paused" not in out.read_text() and client.poll() is None:
            assert time.monotonic() < deadline, "the client did not pause within 180 s"
            time.sleep(0.1)
        assert client.poll() is None, err.read_text(errors="replace")[-3000:]
        during()
        resume.touch()
        code = client.wait(180)
    finally:
        client.kill_group()
    assert code == 0, err.read_text(errors="replace")[-3000:]
    shutil.copy(err, swarm.logs / f"client-paused-at-{pause_at}.log")
    return json.loads(out.read_text().strip().splitlines()[-1])


def reached(swarm: NatSwarm, silent: list | None = None) -> list[tuple[int, str, set[str]]]:
    """(first block, how it is reached, through which relays) of every server that answered, as `corolla
    status --json` shows them; those whose records it read but which did not answer go to `silent`."""
    status = ["status", "--json", "--host", PUBLIC_IP, "--no-nat-port-map", *peer_args([swarm.initial_peer])]
    out = run_corolla(status, env=swarm.env, netns=swarm.net.PUBLIC)[0]
    assert out.returncode == 0, out.stderr[-3000:]
    (model,) = json.loads(out.stdout)  # one model
    if silent is not None:
        silent.extend(model["not_answering"])
    servers = [(s["start"], s["reachability"], {r["relay"] for r in s["relays"]}) for s in model["servers"]]
    return sorted(servers, key=lambda server: (server[0], server[1]))


def start_server(
    swarm_net: NatHarness, path: Path, name: str, blocks: str, where: tuple, peers, env, logs, extra=()
):
    """A server started as the README says (plus `extra` options), on a public host (index, None) or behind a
    router."""
    public, home, symmetric = where
    if public is not None:
        namespace = swarm_net.public_host(public)
        listen = ["--host", "0.0.0.0", "--port", str(PUBLIC_PORT), *RELAY_LIMIT]
    else:
        namespace, listen = swarm_net.home(home, symmetric=symmetric), ["--host", "0.0.0.0"]
    args = [
        "server",
        str(path),
        "--blocks",
        blocks,
        *listen,
        "--no-nat-port-map",
        "--num-threads",
        "1",
        *extra,
    ]
    server = PeerProcess(name, [*args, *peer_args(peers)], logs / f"{name}.log", env, netns=namespace)
    server.home = namespace
    return server


@pytest.fixture(scope="module")
def swarm(tiny_models, tmp_path_factory) -> Iterator[NatSwarm]:
    path = tiny_models["llama"]
    logs = tmp_path_factory.mktemp("nat")
    prompt = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(5))
    expected = reference_generate(load_reference(path), prompt, max_new_tokens=NEW_TOKENS)[0].tolist()
    env = {**os.environ, **ENV}
    servers: list[PeerProcess] = []  # the tests add theirs: every one is stopped at the end
    dht = None
    with NatHarness() as net:
        try:
            dht_args = [
                "dht",
                "--host",
                "0.0.0.0",
                "--port",
                str(DHT_PORT),
                "--no-nat-port-map",
                *RELAY_LIMIT,
            ]
            dht = PeerProcess("dht", dht_args, logs / "dht.log", env, netns=net.PUBLIC)
            address = dht.wait_for(READY_DHT, 60).group(1)
            start = partial(start_server, net, path, peers=[address], env=env, logs=logs)
            servers.append(start("public", "0:2", (1, None, False)))
            servers[0].wait_for(READY_SERVER, 180)  # in the records when the others look for relays
            servers += [start("symmetric", "2:4", (None, 1, True)), start("cone", "4:6", (None, 3, False))]
            # said to be public, behind a router: a model of its own (no client tries it), stopped by test 1
            wrong = ["--public", "--dht-prefix", "wrongly-public"]
            servers.append(start("wrongly-public", "0:2", (None, 5, False), extra=wrong))
            for server in servers[1:3]:
                server.wait_for(READY_SERVER, 180)
            home = net.home(2, symmetric=False)  # the client's own router
            prompt_text = json.dumps(prompt[0].tolist())
            yield NatSwarm(net, dht, servers, address, home, prompt_text, path, expected, env, logs)
        finally:
            for peer in [*reversed(servers), *([dht] if dht is not None else [])]:
                peer.stop(timeout=10)


def test_servers_behind_nat_serve_through_relays(swarm):
    """Each server found out at start how it is reached (one started with --public behind a router says in
    one line that nobody could dial it; the DHT peer, that a peer dialed it back); the DHT peer and the
    public server relay with their own limits; both servers behind NAT hold reservations on both; a public
    client and one behind a router of its own (it needs nothing: it dials out) get the reference tokens;
    `corolla status` shows how each server is reached and through which relays."""
    public, symmetric, cone, wrong = swarm.servers
    line = wrong.wait_for(re.compile(r"WARN corolla.swarm.nat.joining: (.*)"), 60).group(1)
    assert line.startswith(
        "Started with --public, but 1 peer(s) could not dial this one back at /ip4/11.79.0.105"
    )
    wrong.stop(timeout=10)
    swarm.servers.remove(wrong)
    assert swarm.dht.wait_for(RELAYS_OWN_LIMITS, 1)
    assert swarm.dht.wait_for(
        re.compile(r"\d peer\(s\) dialed this one back at /ip4/11\.79\.0\.10/tcp/31330"), 30
    )
    assert public.wait_for(DIALED_BACK, 1) and public.wait_for(RELAYS_OWN_LIMITS, 1)  # said at start
    relays = {swarm.initial_peer.rsplit("/p2p/", 1)[1], peer_id(public)}
    for server in (symmetric, cone):
        assert server.wait_for(NOT_DIALED_BACK, 1)
        held = server.wait_for(
            TWO_RELAYS, 30
        )  # at once, or one round (10 s) after the public server's record
        assert set(held.group(1).split(", ")) == relays
    public_client = run_client(swarm.net.PUBLIC, PUBLIC_IP, swarm.args, swarm.env, swarm.logs)
    assert public_client["tokens"] == swarm.expected
    assert direct(public_client["connections"], public) and not direct(
        public_client["connections"], symmetric
    )
    assert reached(swarm) == [(0, "direct", set()), (2, "relayed", relays), (4, "relayed", relays)]
    assert (
        run_client(swarm.client_home, "0.0.0.0", swarm.args, swarm.env, swarm.logs)["tokens"]
        == swarm.expected
    )


def test_sessions_and_servers_outlive_the_routers_connection_tracking(swarm):
    """The client's router forgets a flow idle for 5 s, the symmetric server's router one idle for 15 s
    (home routers forget in minutes; Linux's default is 5 days; libp2p's keepalive comes every 30 s): a
    session left idle for 12.5 s continues with the same tokens (a cone router maps the flow to the same
    port when the client sends again), and the server stays reachable through its relays while idle for
    1.5 times its router's timeout (its reservations, renewed every 10 s, keep those flows alive)."""
    symmetric = swarm.servers[1]
    swarm.net.forget_idle_flows(swarm.client_home, CONNTRACK_TIMEOUT)
    swarm.net.forget_idle_flows(symmetric.home, SERVER_CONNTRACK_TIMEOUT)
    try:
        tokens = generate_with_a_pause(swarm, 4, lambda: time.sleep(2.5 * CONNTRACK_TIMEOUT))["tokens"]
        assert tokens == swarm.expected
        time.sleep(1.5 * SERVER_CONNTRACK_TIMEOUT)
        result = run_client(swarm.net.PUBLIC, PUBLIC_IP, swarm.args, swarm.env, swarm.logs)
    finally:
        swarm.net.forget_idle_flows(swarm.client_home)
        swarm.net.forget_idle_flows(symmetric.home)
    assert result["tokens"] == swarm.expected and not direct(result["connections"], symmetric)
    assert "Relays changed" not in (swarm.logs / "symmetric.log").read_text()  # its reservations held


def test_a_session_moves_before_the_relays_time_limit(swarm):
    """Every relay ends a connection it relays after 20 s (`--relay-time-limit`), and the servers behind NAT
    announce that limit. The client behind a cone NAT reaches them only through a relay (neither can dial
    the other); without push, its every step goes there. Left idle past the limit, its session moves to
    new connections before its next step (no step is cut) and continues with the same tokens."""
    symmetric = swarm.servers[1]
    result = generate_with_a_pause(swarm, 5, partial(time.sleep, RELAY_TIME_LIMIT + 5), push=False)
    assert result["tokens"] == swarm.expected
    assert not direct(result["connections"], symmetric)
    log = (swarm.logs / "client-paused-at-5.log").read_text()
    assert f"Moving the session on server ...{peer_id(symmetric)[-6:]} to a new connection" in log
    assert " failed (" not in log


def test_the_swarm_outlives_its_dht_peer(swarm):
    """The DHT peer, a relay of both servers behind NAT, dies (kill -9) mid-session: the session continues
    with the same tokens; both servers say so and stay reachable through the public server; a server behind
    NAT started then with the public server as its only initial peer reserves on it."""
    public, symmetric, cone = swarm.servers
    dht_id = swarm.initial_peer.rsplit("/p2p/", 1)[1]
    assert generate_with_a_pause(swarm, 6, swarm.dht.kill_group)["tokens"] == swarm.expected
    for server in (symmetric, cone):
        assert server.wait_for(re.compile(rf"Relays changed \(gone: {dht_id}\)"), 30)
    swarm.initial_peer = f"/ip4/11.79.0.21/tcp/{PUBLIC_PORT}/p2p/{peer_id(public)}"
    late = start_server(
        swarm.net, swarm.path, "late", "2:4", (None, 4, False), [swarm.initial_peer], swarm.env, swarm.logs
    )
    swarm.servers.append(late)
    late.wait_for(READY_SERVER, 180)
    assert late.wait_for(RELAYED, 40).group(2) == peer_id(public)
    # `corolla status` counts only servers that answer its ping through their relays, and reads each block's
    # records once through the one public peer left: on a loaded machine a first relayed connection may miss
    # the ping, or a read the late server's first announcement, so it is asked again, as a user would
    expected = [(2, "relayed", {peer_id(public)})] * 2
    for _ in range(4):
        silent: list = []
        found = [server for server in reached(swarm, silent) if server[0] == 2]
        if found == expected:
            break
        time.sleep(5)
    assert found == expected, f"not answering: {silent}; the late server's log: {late.log_tail()}"


def test_a_server_whose_only_relay_dies_is_reached_through_another(swarm):
    """A second public server joins; the servers behind NAT, down to one relay, reserve on it too. The first
    public server (a server of the chain, and until then the only relay) then dies mid-session: the session
    fails over to the second for blocks 0:2 and keeps reaching the servers behind NAT, with the same
    tokens."""
    public, symmetric, cone = swarm.servers[:3]
    second = start_server(
        swarm.net, swarm.path, "second", "0:2", (2, None, False), [swarm.initial_peer], swarm.env, swarm.logs
    )
    swarm.servers.append(second)
    second.wait_for(READY_SERVER, 180)
    both = re.compile(rf"reachable through 2 relay\(s\) \([^)]*{peer_id(second)}")
    for server in (symmetric, cone):
        assert server.wait_for(both, 60)
    result = generate_with_a_pause(swarm, 6, public.kill_group)
    assert result["tokens"] == swarm.expected
    for server in (symmetric, cone):
        assert server.wait_for(re.compile(rf"Relays changed \(gone: {peer_id(public)}\)"), 30)
