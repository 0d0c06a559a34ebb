"""Servers with quantized weights (int8 / int4), among corolla's own servers in this process
(tests/loopback.py): a chain mixing them with full-precision servers works and stays close to
transformers; each server reports its weights' precision (rpc_info, its DHT record, `corolla status`'s
table); a client with `exact` routes around the quantized ones and gets exact tokens."""

from __future__ import annotations

import pytest
import torch

from corolla.models.head import ModelHead
from corolla.models.span import Span
from corolla.swarm.p2p.ping import fetch_status
from corolla.swarm.records.overview import build_overview, format_table
from loopback import PREFIX, LoopbackSwarm
from swarm_helpers import reference_generate
from tiny_models import load_reference

PRECISIONS = ["float32", "int8", "int4", "float32"]  # of the servers below, in order


@pytest.fixture(scope="module")
def mixed_precision(tiny_models):
    path = tiny_models["qwen3"]
    with LoopbackSwarm(path, [(0, 3)]) as swarm:
        for mode in ("int8", "int4"):
            swarm.add_server((3, 6), quantize=mode)
        swarm.add_server((3, 6))
        yield swarm, load_reference(path)


def test_servers_report_their_weights_precision(mixed_precision):
    swarm, _ = mixed_precision
    model = swarm.model()
    reports = [
        model.runtime.run(fetch_status(model.client.swarm.peers.transport, s.peer_id, 10.0))
        for s in swarm.servers
    ]
    assert [(info.precision, info.quantized, info.dtype) for info in reports] == [
        ("float32", False, "float32"),
        ("int8", True, "float32"),
        ("int4", True, "float32"),
        ("float32", False, "float32"),
    ]
    # what the DHT holds (each server's record), as `corolla status` prints it: a column "weights"
    records = [server.record() for server in swarm.servers]
    assert [record.info.precision for record in records] == PRECISIONS
    table = format_table(build_overview(PREFIX, 6, records)).splitlines()
    column = table[3].index("weights")
    for server, precision in zip(swarm.servers, PRECISIONS, strict=True):
        line = next(line for line in table if line.startswith(f"...{server.peer_id[-8:]}"))
        assert line[column:].split()[0] == precision


@pytest.mark.parametrize("quantized", [1, 2], ids=["int8", "int4"])
def test_a_chain_through_a_quantized_server_stays_close_to_full_precision(mixed_precision, quantized):
    swarm, reference = mixed_precision
    input_ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(quantized))
    chain = [swarm.servers[i].peer_id for i in (0, quantized)]
    model = swarm.model(allowed_servers=tuple(chain))
    logits = model(input_ids).logits
    with model.inference_session(max_length=16) as session:
        session.step(model.head.embed(input_ids))
        assert [hop.peer_id for hop in session.route] == chain
    with torch.no_grad():
        expected = reference(input_ids).logits
    error = ((logits - expected).norm() / expected.norm()).item()
    assert 0 < error < (0.03 if quantized == 1 else 0.25), error  # lossy, measurably, and within bounds


def test_an_exact_client_skips_quantized_servers(mixed_precision):
    swarm, reference = mixed_precision
    input_ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(5))
    expected = reference_generate(reference, input_ids, max_new_tokens=12)
    quantized = {swarm.servers[1].peer_id, swarm.servers[2].peer_id}
    model = swarm.model(exact=True)
    for _ in range(4):  # routing picks at random among equals: never a quantized server
        with model.inference_session(max_length=16) as session:
            session.step(model.head.embed(input_ids))
            assert not {hop.peer_id for hop in session.route} & quantized
    assert torch.equal(model.generate(input_ids, max_new_tokens=12), expected)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_moe_servers_with_quantized_experts_compute_what_their_quantized_spans_compute(tiny_models, mode):
    """DeepSeek-V3's fused experts become int8 (either mode), its latent attention's linears int8 or
    int4: servers of such spans give what the same quantized spans give run locally, and decode."""
    path = tiny_models["deepseek_v3"]
    input_ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(6))
    head = ModelHead.load(path)
    hidden = head.embed(input_ids)
    with torch.no_grad():
        for blocks in [(0, 3), (3, 6)]:
            hidden = Span.load(path, *blocks, quantize=mode)(hidden)
        expected = head.logits(hidden)
    with LoopbackSwarm(path, []) as swarm:
        for blocks in [(0, 3), (3, 6)]:
            swarm.add_server(blocks, quantize=mode)
        model = swarm.model()
        torch.testing.assert_close(model(input_ids).logits, expected, atol=1e-3, rtol=1e-3)
        tokens = model.generate(input_ids, max_new_tokens=6)
        assert tokens.shape == (2, 15) and all(s.record().info.precision == mode for s in swarm.servers)
