"""Servers behind emulated home routers (tests/nat_harness.py): reachable through relays, their tokens
those of transformers on the same checkpoint.

Four `corolla dht --public` peers on the public side are the relays (libp2p takes a reservation at once
only when it knows four; with fewer it waits 3 minutes). A server behind a symmetric NAT (a new port per
flow: no hole punching, no dialing in) runs with `--behind-nat`; a public server hands it the first
span's outputs (push) and the client reaches it only through a relay: a public client, then one behind a
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
READY_RELAY = re.compile(r"--initial-peers (/ip4/11\.79\.0\.10/\S+)")
RELAYED = re.compile(r"Behind NAT, reachable through (\d+) relay\(s\)")
ENV = {
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
NEW_TOKENS = 12


def start_relays(net: NatHarness, logs: Path, env: dict, peers: list) -> list[str]:
    relays: list[str] = []
    for index in range(4):
        args = ["dht", "--host", PUBLIC_IP, "--port", str(31330 + index), "--no-nat-port-map", "--public"]
        log = logs / f"relay{index}.log"
        relay = PeerProcess(f"relay {index}", [*args, *peer_args(relays[:1])], log, env, net.exec(net.PUBLIC))
        peers.append(relay)
        relays.append(relay.wait_for(READY_RELAY, 60).group(1))
    return relays


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


def test_a_server_behind_a_symmetric_nat_serves_through_a_relay(tiny_models, tmp_path):
    path = tiny_models["llama"]
    prompt = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(5))
    expected = reference_generate(load_reference(path), prompt, max_new_tokens=NEW_TOKENS)
    env = {**os.environ, **ENV}
    peers: list[PeerProcess] = []
    with NatHarness() as net:
        home = net.home(1, symmetric=True)
        try:
            relays = start_relays(net, tmp_path, env, peers)
            common = ["--no-nat-port-map", "--num-threads", "1", *peer_args(relays)]
            public = ["server", str(path), "--blocks", "0:3", "--host", PUBLIC_IP, "--public", *common]
            behind = ["server", str(path), "--blocks", "3:6", "--host", "0.0.0.0", "--behind-nat", *common]
            peers.append(PeerProcess("public", public, tmp_path / "public.log", env, net.exec(net.PUBLIC)))
            peers.append(PeerProcess("behind NAT", behind, tmp_path / "behind.log", env, net.exec(home)))
            for server in peers[-2:]:
                server.wait_for(READY_SERVER, 180)
            assert int(peers[-1].wait_for(RELAYED, 10).group(1)) >= 1  # said at start, before ready
            args = [str(path), json.dumps(prompt[0].tolist()), str(NEW_TOKENS), *relays]
            assert generate(net.exec(net.PUBLIC), PUBLIC_IP, args, env) == expected[0].tolist()
            assert reached(net, relays, env) == {(0, "direct"), (3, "relayed")}
            # a client behind a router of its own (cone NAT) needs nothing: it dials out
            client_home = net.home(2, symmetric=False)
            assert generate(net.exec(client_home), "0.0.0.0", args, env) == expected[0].tolist()
        finally:
            for peer in reversed(peers):
                peer.stop(timeout=10)
