"""Spot checks against real servers that lie (--simulate-faulty): caught, banned, and their tokens redone.

Two honest replicas of every block and, per fault mode, one faulty server that the client prefers (it has
timed the honest ones as slow: they are, with --simulate-slow-ms). With spot checks on 10% of the steps,
the client catches the faulty server, bans it for good, rewinds to its first wrong output and generates
exactly the reference model's greedy tokens; an honest replica in another precision is never accused.
"""

from __future__ import annotations

import pytest
import torch

from corolla.swarm.local import LocalSwarm
from swarm_helpers import connect, reference_generate
from tiny_models import load_reference

PROMPT = torch.tensor([[1, 5, 9, 22, 7, 31, 4]])
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def replicas(tiny_models):
    with LocalSwarm(
        str(tiny_models["llama"]), [(0, 6), (0, 3), (3, 6)], server_args=["--simulate-slow-ms", "30"]
    ) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def expected(tiny_models):
    return reference_generate(load_reference(tiny_models["llama"]), PROMPT, max_new_tokens=NEW_TOKENS)


@pytest.mark.parametrize("fault", ["noise:0.1", "skip-layer", "wrong-weights", "garbage-after:12"])
def test_a_lying_server_is_caught_and_its_tokens_redone(replicas, tiny_models, expected, fault):
    liar = replicas.add_server((0, 6), ["--simulate-slow-ms", "0", "--simulate-faulty", fault])
    try:
        with connect(tiny_models["llama"], replicas, spot_checks=0.1) as model:
            for honest in replicas.servers[:3]:  # as if timed: the honest replicas are slow, the liar fast
                model.swarm.estimates.observe_step(honest.peer_id, 1.0, 3)
            model.swarm.estimates.observe_step(liar.peer_id, 0.01, 6)
            tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            assert torch.equal(tokens, expected)
            assert set(model.swarm.faulty) == {liar.peer_id}, model.swarm.faulty
            counts = model.swarm.spot_checker.counts
            assert counts["failed"] == 1 and counts["passed"] >= 1, counts
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
            for _ in range(3):
                model.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            counts = model.swarm.spot_checker.counts
            assert model.swarm.faulty == {} and counts["failed"] == 0, (model.swarm.faulty, counts)
            assert counts["passed"] >= 3 * NEW_TOKENS, counts
    finally:
        for server in others:
            replicas.servers.remove(server)
            server.stop()
