"""A server of another model announced under SmolLM2's prefix (a hidden-size-64 Llama claiming blocks
15:30, with many times the throughput): clients route around it, `corolla status` and the dashboard
show it as another model and do not count it, and one that is reached anyway counts as a failed server."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from corolla.errors import ServerUnavailable
from corolla.launch.local import LocalSwarm
from corolla.models.source import dht_prefix_for, resolve_model
from corolla.swarm.policy.routing import Hop
from corolla.swarm.records.overview import read_overview
from swarm_helpers import connect, run_corolla

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 2]


def save_impostor(path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=30, num_attention_heads=4
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mixed_swarm(smollm2_path, tmp_path_factory):
    prefix = dht_prefix_for(resolve_model(str(smollm2_path)).name)
    impostor_model = save_impostor(tmp_path_factory.mktemp("impostor") / "tiny-llama-30")
    with LocalSwarm(str(smollm2_path), [(0, 15), (15, 30)]) as swarm:
        impostors = LocalSwarm(str(impostor_model), [], dht_prefix=prefix, workdir=swarm.workdir / "impostor")
        impostors.initial_peers = swarm.initial_peers  # joins the same swarm, under SmolLM2's prefix
        try:
            impostor = impostors.add_server((15, 30))
            yield swarm, impostor, prefix
        finally:
            impostors.stop()


def test_clients_route_around_it_and_generate_as_without_it(smollm2_path, mixed_swarm):
    swarm, impostor, _ = mixed_swarm
    honest = [server.peer_id for server in swarm.servers]
    with connect(smollm2_path, swarm, allowed_servers=tuple(honest)) as model:
        expected = model.generate(PROMPT, max_new_tokens=8)
    with connect(smollm2_path, swarm) as model:
        with model.inference_session(max_length=len(PROMPT) + 8) as session:
            tokens = model.generate(PROMPT, session=session, max_new_tokens=8)
            assert impostor.peer_id not in [hop.peer_id for hop in session.route]
        assert impostor.peer_id in model.client.swarm.view.mismatched
        overview = model.runtime.run(
            read_overview(model.client.dht, model.client.dht_prefix, 30, model.client.model_fingerprint)
        )
    assert torch.equal(tokens, expected)
    rows = {row["peer_id"]: row for row in overview.to_dict()["servers"]}  # the dashboard's JSON
    assert rows[impostor.peer_id]["state"] == "other model"
    assert overview.coverage == (1,) * 30


def corolla_status(swarm: LocalSwarm, *args: str) -> str:
    (result,) = run_corolla(["status", *args, "--initial-peers", swarm.initial_peers[0]])
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_status_shows_it_as_another_model(mixed_swarm):
    swarm, impostor, prefix = mixed_swarm
    out = corolla_status(swarm, "--model", prefix)
    (line,) = [line for line in out.splitlines() if line.startswith(f"...{impostor.peer_id[-8:]}")]
    assert "other model" in line
    assert "coverage (servers per block, 0-29): " + "1" * 30 in out


def test_status_shows_the_sessions_running_now(smollm2_path, mixed_swarm):
    """Live figures (rpc_info), not the last announcement (up to an announce period, 30 s, old)."""
    swarm, _, prefix = mixed_swarm
    with connect(smollm2_path, swarm) as model, contextlib.ExitStack() as stack:
        hidden = model.head.embed(torch.tensor([PROMPT]))
        for _ in range(3):
            session = stack.enter_context(model.inference_session(max_length=len(PROMPT) + 4))
            session.step(hidden)
        status = corolla_status(swarm, "--model", prefix, "--json")
    (overview,) = json.loads(status)
    sessions = {row["peer_id"]: row["num_sessions"] for row in overview["servers"]}
    assert [sessions[server.peer_id] for server in swarm.servers] == [3, 3]


def test_a_server_refusing_a_well_formed_request_is_a_failed_server(smollm2_path, mixed_swarm):
    """Reached anyway (by a client too old to check fingerprints, say): its refusal of our hidden states
    is its fault, not ours, so it is a retryable ServerUnavailable, never the client's InvalidRequest."""
    swarm, impostor, prefix = mixed_swarm
    with connect(smollm2_path, swarm) as model:
        hidden = model.head.embed(torch.tensor([PROMPT]))
        hop = Hop(impostor.peer_id, 15, 30)
        with pytest.raises(ServerUnavailable, match="refused a well-formed request: .*hidden_states"):
            model.runtime.run(model.client.swarm.peers.forward(hop, hidden))
