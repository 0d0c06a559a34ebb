"""Servers behind emulated home routers (tests/nat_harness.py): reachable through relays, their tokens
those of transformers on the same checkpoint.

Four `corolla dht --public` peers on the public side are the relays (libp2p takes a reservation at once
only when it knows four; with fewer it waits 3 minutes). A chain of three servers: a public one, one
behind a symmetric NAT (a new port per flow: no hole punching, no dialing in) and one behind a cone NAT,
both with `--behind-nat`, push on (the default: a server sends its outputs to the next, through a relay to
a server behind NAT); the client reaches them only through relays: a public client, then one behind a
router of its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from corolla.launch.local import READY_SERVER, PeerProcess
from corolla.swarm.addresses import peer_args
from nat_harness import PUBLIC_IP, NatHarness
from swarm_helpers import reference_generate
from tiny_models import load_reference

pytestmark = pytest.mark.skipif(NatHarness.available() is not None, reason=str(NatHarness.available()))

CLIENT = Path(__file__).resolve().parents[1] / "nat_client.py"
RELAYED = re.compile(r"Behind NAT, reachable through (\d+) relay\(s\)")
DIALED_BACK = re.compile(r"peer\(s\) dialed this one back at /ip4/11\.79\.0\.10/tcp/")
NOT_DIALED_BACK = re.compile(r"Not reachable directly: \d peer\(s\) could not dial this one back at /ip4/11")
ENV = {
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
NEW_TOKENS = 12


def generate(namespace: list[str], host: str, args: list[str], env: dict) -> list[int]:
    """Greedy tokens from tests/nat_client.py run in `namespace`, listening on `host`."""
    model, prompt, new_tokens, *peers = args
    command = [*namespace, sys.executable, str(CLIENT), model, host, prompt, new_tokens, *peers]
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens"]


def reached(net: NatHarness, relays: list[str], env: dict) -> set[tuple[int, str]]:
    """(first block, how it is reached) of every server, as `corolla status --json` shows them."""
    status = [*net.exec(net.PUBLIC), sys.executable, "-m", "corolla", "status", "--json"]
    status += ["--host", PUBLIC_IP, "--no-nat-port-map", *peer_args(relays)]
    out = subprocess.run(status, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    (swarm,) = json.loads(out.stdout)  # one model
    return {(server["start"], server["reachability"]) for server in swarm["servers"]}


def start_servers(net: NatHarness, path: Path, relays: list[str], env: dict, peers: list, logs: Path) -> None:
    """Blocks 0:2 on a public server, 2:4 behind a symmetric NAT, 4:6 behind a cone NAT."""
    common = ["--no-nat-port-map", "--num-threads", "1", *peer_args(relays)]
    places = [
        ("public", "0:2", net.PUBLIC, ["--host", PUBLIC_IP]),  # found reachable: peers dial it back
        ("symmetric", "2:4", net.home(1, symmetric=True), ["--host", "0.0.0.0", "--behind-nat"]),
        ("cone", "4:6", net.home(3, symmetric=False), ["--host", "0.0.0.0"]),  # found behind NAT
    ]
    for name, blocks, namespace, where in places:
        args = ["server", str(path), "--blocks", blocks, *where, *common]
        peers.append(PeerProcess(name, args, logs / f"{name}.log", env, net.exec(namespace)))
    for server in peers[-3:]:
        server.wait_for(READY_SERVER, 180)
    public, symmetric, cone = peers[-3:]
    assert public.wait_for(DIALED_BACK, 1)  # said at start, before ready
    assert cone.wait_for(NOT_DIALED_BACK, 1)
    for server in (symmetric, cone):
        assert int(server.wait_for(RELAYED, 10).group(1)) >= 1


def test_servers_behind_nat_serve_through_relays(tiny_models, tmp_path):
    """A chain of three servers, two behind NAT (one symmetric, one cone), with push between them."""
    path = tiny_models["llama"]
    prompt = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(5))
    expected = reference_generate(load_reference(path), prompt, max_new_tokens=NEW_TOKENS)[0].tolist()
    env = {**os.environ, **ENV}
    peers: list[PeerProcess] = []
    with NatHarness() as net:
        try:
            relays = net.start_relays(tmp_path, env, peers)
            start_servers(net, path, relays, env, peers, tmp_path)
            args = [str(path), json.dumps(prompt[0].tolist()), str(NEW_TOKENS), *relays]
            assert generate(net.exec(net.PUBLIC), PUBLIC_IP, args, env) == expected
            assert reached(net, relays, env) == {(0, "direct"), (2, "relayed"), (4, "relayed")}
            # a client behind a router of its own (cone NAT) needs nothing: it dials out
            client_home = net.home(2, symmetric=False)
            assert generate(net.exec(client_home), "0.0.0.0", args, env) == expected
        finally:
            for peer in reversed(peers):
                peer.stop(timeout=10)
