"""Spot checks against real servers that lie (--simulate-faulty): caught, banned, and their tokens redone.

Two honest replicas of every block and, per fault mode, one faulty server that the client prefers (it has
timed the honest ones as slow: they are, with --simulate-slow-ms). With spot checks on 10% of the steps,
the client catches the faulty server, bans it for good, rewinds to its first wrong output and generates
exactly the reference model's greedy tokens; an honest replica in another precision is never accused.
Training passes are checked too: a liar's forward or backward is caught and redone on honest servers.
"""

from __future__ import annotations

import pytest
import torch

from corolla.client.training import RemoteChain
from corolla.launch.local import LocalSwarm
from corolla.swarm.overview import format_table, read_overview
from swarm_helpers import connect, reference_generate, wait_until
from tiny_models import load_reference

PROMPT = torch.tensor([[1, 5, 9, 22, 7, 31, 4]])
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def replicas(tiny_models):
    with LocalSwarm(
        str(tiny_models["llama"]), [(0, 6), (0, 3), (3, 6)], server_args=["--simulate-slow-ms", "10"]
    ) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def expected(tiny_models):
    return reference_generate(load_reference(tiny_models["llama"]), PROMPT, max_new_tokens=NEW_TOKENS)


def assert_reported(model, peer_id: str) -> None:
    swarm = model.swarm

    async def reported():
        overview = await read_overview(swarm.dht, swarm.dht_prefix, swarm.num_blocks, swarm.model_fingerprint)
        return overview if peer_id in dict(overview.reported_faulty) else None

    overview = model.runtime.run(wait_until(reported, timeout=10))
    assert overview is not None, "the client's report never reached the DHT"
    assert dict(overview.reported_faulty)[peer_id][0].startswith("wrong outputs for blocks 0:6")
    assert f"reported faulty by the spot checks of 1 client: ...{peer_id[-8:]}" in format_table(overview)


@pytest.mark.parametrize("fault", ["noise:0.1", "skip-layer", "wrong-weights", "garbage-after:12"])
def test_a_lying_server_is_caught_and_its_tokens_redone(replicas, tiny_models, expected, fault):
    liar = replicas.add_server((0, 6), ["--simulate-slow-ms", "0", "--simulate-faulty", fault])
    try:
        with connect(tiny_models["llama"], replicas, spot_checks=0.1) as model:
            for honest in replicas.servers[:3]:  # as if timed: the honest replicas are slow, the liar fast
                model.client.swarm.estimates.observe_step(honest.peer_id, 1.0, 3)
            model.client.swarm.estimates.observe_step(liar.peer_id, 0.01, 6)
            tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            assert torch.equal(tokens, expected)
            assert set(model.client.swarm.bans.faulty) == {liar.peer_id}, model.client.swarm.bans.faulty
            counts = model.client.checker.counts
            assert counts["failed"] == 1 and counts["passed"] >= 1, counts
            if fault == "wrong-weights":  # reported to the swarm, signed: what `corolla status` shows
                assert_reported(model, liar.peer_id)
    finally:
        replicas.servers.remove(liar)
        liar.stop()


def test_honest_replicas_in_other_precisions_are_never_accused(replicas, tiny_models, expected):
    """float16 next to float32 here: a tiny random model drifts too far in bfloat16 or int8 (up to 0.7 and
    0.4) for any tolerance; SmolLM2 in every precision is bench/spot_checks.py's false-alarm run."""
    others = [
        replicas.add_server((0, 6), ["--simulate-slow-ms", "0", *extra])
        for extra in (["--dtype", "float16"],)
    ]
    try:
        with connect(tiny_models["llama"], replicas, spot_checks=1.0) as model:
            model.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            counts = model.client.checker.counts
            assert model.client.swarm.bans.faulty == {} and counts["failed"] == 0, (
                model.client.swarm.bans.faulty,
                counts,
            )
            assert counts["passed"] >= NEW_TOKENS, counts
    finally:
        for server in others:
            replicas.servers.remove(server)
            server.stop()


def chain_pass(model, hidden, grad_outputs, share_forward, share_backward):
    """Outputs and input gradients of the whole chain (RemoteChain) with these spot-check shares."""
    checker, hidden = model.client.checker, hidden.clone().requires_grad_(True)
    checker.share = share_forward
    outputs = RemoteChain.apply(hidden, torch.empty(0), model.swarm, model.runtime)
    checker.share = share_backward
    outputs.backward(grad_outputs)
    return outputs.detach(), hidden.grad


def test_a_server_lying_in_training_is_caught_and_its_pass_redone(replicas, tiny_models):
    """wrong-weights corrupts a forward's outputs and a backward's gradients. A client checking only the
    forward, then another checking only the backward: each bans the liar and redoes the pass on honest
    servers, so the outputs (forward) and the input gradients (both: a backward recomputes from the
    hop's inputs) are the honest ones."""
    generator = torch.Generator().manual_seed(11)
    hidden, grad_outputs = (
        torch.randn(2, 6, 64, generator=generator),
        torch.randn(2, 6, 64, generator=generator),
    )
    with connect(tiny_models["llama"], replicas, spot_checks=1.0) as model:
        honest_outputs, honest_grad = chain_pass(model, hidden, grad_outputs, 0.0, 0.0)
    liar = replicas.add_server((0, 6), ["--simulate-slow-ms", "0", "--simulate-faulty", "wrong-weights"])
    try:
        for shares in ((1.0, 0.0), (0.0, 1.0)):
            with connect(tiny_models["llama"], replicas, spot_checks=1.0) as model:
                for honest in replicas.servers[:3]:
                    model.client.swarm.estimates.observe_step(honest.peer_id, 1.0, 3)
                model.client.swarm.estimates.observe_step(liar.peer_id, 0.01, 6)
                outputs, grad = chain_pass(model, hidden, grad_outputs, *shares)
                assert set(model.client.swarm.bans.faulty) == {liar.peer_id}, (
                    shares,
                    model.client.swarm.bans.faulty,
                )
                if shares[0]:
                    torch.testing.assert_close(outputs, honest_outputs, atol=1e-5, rtol=1e-5)
                else:  # the forward went through the liar unchecked: its outputs are wrong
                    assert not torch.allclose(outputs, honest_outputs, atol=1e-3)
                torch.testing.assert_close(grad, honest_grad, atol=1e-5, rtol=1e-5)
                assert model.client.checker.counts["failed"] == 1
    finally:
        replicas.servers.remove(liar)
        liar.stop()


def test_training_passes_on_honest_servers_pass_their_checks(replicas, tiny_models):
    """Deep prompts' gradients too: a model tuned with deep prompts, every pass checked."""
    input_ids = torch.randint(3, 300, (2, 7), generator=torch.Generator().manual_seed(5))
    with connect(tiny_models["llama"], replicas, tuning_mode="deep_ptune", pre_seq_len=3) as model:
        with torch.no_grad():
            model.ptune.deep_prompts.normal_(std=0.05, generator=torch.Generator().manual_seed(0))
        model(input_ids, labels=input_ids).loss.backward()
        expected = [p.grad.clone() for p in model.parameters()]
        state = model.ptune.state_dict()
    with connect(
        tiny_models["llama"], replicas, tuning_mode="deep_ptune", pre_seq_len=3, spot_checks=1.0
    ) as model:
        model.ptune.load_state_dict(state)
        model(input_ids, labels=input_ids).loss.backward()
        for got, want in zip([p.grad for p in model.parameters()], expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        counts = model.client.checker.counts
        assert counts["failed"] == 0 and counts["passed"] >= 2, counts
