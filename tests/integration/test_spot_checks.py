"""Spot checks against a real server that lies (--simulate-faulty wrong-weights): caught, banned, its tokens
redone, and reported to the swarm in a signed DHT record that `corolla status` shows. Every fault mode,
the consumers of withdrawn tokens, honest replicas in other precisions and training passes are tested
socket-free on the same server code (tests/unit/client/test_spot_checks.py).
"""

from __future__ import annotations

import pytest
import torch

from corolla.launch.local import LocalSwarm
from corolla.swarm.records.overview import format_table, read_overview
from swarm_helpers import connect, reference_generate, wait_until
from tiny_models import load_reference

PROMPT = torch.tensor([[1, 5, 9, 22, 7, 31, 4]])
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def replicas(tiny_models):
    with LocalSwarm(
        str(tiny_models["llama"]), [(0, 6), (0, 3), (3, 6)], server_args=["--simulate-slow-ms", "10"]
    ) as swarm:
        yield swarm


def assert_reported(model, peer_id: str) -> None:
    client = model.client

    async def reported():
        overview = await read_overview(client.dht, client.dht_prefix, 6, client.model_fingerprint)
        return overview if peer_id in dict(overview.reported_faulty) else None

    overview = model.runtime.run(wait_until(reported, timeout=10))
    assert overview is not None, "the client's report never reached the DHT"
    assert dict(overview.reported_faulty)[peer_id][0].startswith("wrong outputs for blocks 0:6")
    assert f"reported faulty by the spot checks of 1 client: ...{peer_id[-8:]}" in format_table(overview)


def test_a_lying_server_is_caught_its_tokens_redone_and_reported(replicas, tiny_models):
    expected = reference_generate(load_reference(tiny_models["llama"]), PROMPT, max_new_tokens=NEW_TOKENS)
    liar = replicas.add_server((0, 6), ["--simulate-slow-ms", "0", "--simulate-faulty", "wrong-weights"])
    with connect(tiny_models["llama"], replicas, spot_checks=0.1) as model:
        for honest in replicas.servers[:3]:  # as if timed: the honest replicas are slow, the liar fast
            model.client.swarm.estimates.observe_step(honest.peer_id, 1.0, 3)
        model.client.swarm.estimates.observe_step(liar.peer_id, 0.01, 6)
        tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        assert torch.equal(tokens, expected)
        assert set(model.client.swarm.bans.faulty) == {liar.peer_id}
        counts = model.client.checker.counts
        assert counts["failed"] == 1 and counts["passed"] >= 1, counts
        assert_reported(model, liar.peer_id)
