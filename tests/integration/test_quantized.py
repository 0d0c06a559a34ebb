"""Servers started with --quantize int8 / int4: a chain mixing them with full-precision servers works and
stays close to transformers; each server announces its weights' precision (rpc_info, DHT record,
`corolla status`); a client with `exact` routes around the quantized ones and gets exact tokens."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from corolla.launch.local import LocalSwarm
from swarm_helpers import connect, reference_generate
from tiny_models import load_reference

PRECISIONS = ["float32", "int8", "int4", "float32"]  # of the servers below, in order


@pytest.fixture(scope="module")
def mixed_precision(tiny_models):
    path = tiny_models["qwen3"]
    with LocalSwarm(str(path), [(0, 3)]) as swarm:
        for mode in ("int8", "int4"):
            swarm.add_server((3, 6), extra_args=["--quantize", mode])
        swarm.add_server((3, 6))
        yield path, swarm, load_reference(path)


def test_servers_announce_their_weights_precision(mixed_precision):
    path, swarm, _ = mixed_precision
    with connect(path, swarm) as model:
        precisions = {}
        for server in swarm.servers:
            info = model.runtime.run(model.client.swarm.peers.status(server.peer_id))
            precisions[server.peer_id] = (info.precision, info.quantized, info.dtype)
    assert [precisions[s.peer_id] for s in swarm.servers] == [
        ("float32", False, "float32"),
        ("int8", True, "float32"),
        ("int4", True, "float32"),
        ("float32", False, "float32"),
    ]
    command = [sys.executable, "-m", "corolla", "status", "--no-nat-port-map", "--initial-peers"]
    out = subprocess.run(
        [*command, *swarm.initial_peers], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "weights" in out
    for server, precision in zip(swarm.servers, PRECISIONS, strict=True):
        line = next(line for line in out.splitlines() if line.startswith(f"...{server.peer_id[-8:]}"))
        assert line.split()[-1] == precision


@pytest.mark.parametrize("quantized", [1, 2], ids=["int8", "int4"])
def test_a_chain_through_a_quantized_server_stays_close_to_full_precision(mixed_precision, quantized):
    path, swarm, reference = mixed_precision
    input_ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(quantized))
    with connect(path, swarm, servers=[0, quantized]) as model:
        logits = model(input_ids).logits
        with model.inference_session(max_length=16) as session:
            session.step(model.head.embed(input_ids))
            assert [hop.peer_id for hop in session.route] == [
                swarm.servers[i].peer_id for i in (0, quantized)
            ]
    with torch.no_grad():
        expected = reference(input_ids).logits
    error = ((logits - expected).norm() / expected.norm()).item()
    assert 0 < error < (0.03 if quantized == 1 else 0.25), error  # lossy, measurably, and within bounds


def test_an_exact_client_skips_quantized_servers(mixed_precision):
    path, swarm, reference = mixed_precision
    input_ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(5))
    expected = reference_generate(reference, input_ids, max_new_tokens=12)
    quantized = {swarm.servers[1].peer_id, swarm.servers[2].peer_id}
    with connect(path, swarm, exact=True) as model:
        for _ in range(4):  # routing picks at random among equals: never a quantized server
            with model.inference_session(max_length=16) as session:
                session.step(model.head.embed(input_ids))
                assert not {hop.peer_id for hop in session.route} & quantized
        assert torch.equal(model.generate(input_ids, max_new_tokens=12), expected)
