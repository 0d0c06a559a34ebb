"""Real server processes die or drain mid-generation; the client routes around them and the tokens do not
change. What these prove over the socket-free failover tests (tests/unit/client/test_chain.py,
test_generation.py): SIGKILL to a whole process group (server, DHT child, libp2p daemon) ends the
client's stream at once, and a draining server finishes its sessions while new ones go elsewhere."""

from __future__ import annotations

import logging
import signal
import threading

import pytest
import torch

from corolla.launch.local import LocalSwarm
from swarm_helpers import connect, reference_generate
from tiny_models import load_reference

SPANS = [(0, 3), (3, 6)]
NEW_TOKENS = 16
PROMPT = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(8))
SLOW = ["--simulate-slow-ms", "100"]  # after each engine pass: a long prefill takes several of them


@pytest.fixture(scope="module")
def replicated(tiny_models):
    """Two servers for each half of the tiny llama."""
    with LocalSwarm(
        str(tiny_models["llama"]), SPANS + SPANS, server_args=["--announce-period", "2", *SLOW]
    ) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def expected(tiny_models):
    return reference_generate(load_reference(tiny_models["llama"]), PROMPT, max_new_tokens=NEW_TOKENS)


def restore(swarm: LocalSwarm, victim) -> None:
    """Bring the swarm back to two replicas per half for the next test."""
    swarm.servers.remove(victim)
    swarm.add_server(victim.blocks, extra_args=["--announce-period", "2", *SLOW])


def test_a_generation_survives_a_server_killed_with_its_process_group(tiny_models, replicated, expected):
    length = PROMPT.shape[1] + NEW_TOKENS
    with connect(tiny_models["llama"], replicated) as model, model.inference_session(length) as session:
        killed = []

        def on_token(_):
            killed.append(None)
            if len(killed) == NEW_TOKENS // 2:
                victim = next(s for s in replicated.servers if s.peer_id == session.route[-1].peer_id)
                victim.kill_group()
                killed[-1] = victim

        tokens = model.generate(PROMPT, session=session, max_new_tokens=NEW_TOKENS, streamer=on_token)
        assert session.num_failovers == 1
    assert torch.equal(tokens, expected)
    restore(replicated, killed[NEW_TOKENS // 2 - 1])


def test_a_server_killed_while_it_computes_a_step_is_noticed_by_its_streams_end(
    tiny_models, replicated, caplog
):
    """The first server dies in the middle of a long prefill step: the end of its stream, not the request
    timeout, tells the client, which replays the step on a replica (the same outputs)."""
    ids = torch.randint(3, 300, (1, 480), generator=torch.Generator().manual_seed(0))
    with connect(tiny_models["llama"], replicated, request_timeout=600.0) as model:
        hidden = model.head.embed(ids)
        with model.inference_session(max_length=ids.shape[1]) as session:
            session.step(hidden[:, :8])
            expected = session.step(hidden[:, 8:])
        with model.inference_session(max_length=ids.shape[1]) as session, caplog.at_level(logging.WARNING):
            session.step(hidden[:, :8])  # the route is chosen, the streams are open
            victim = next(s for s in replicated.servers if s.peer_id == session.route[0].peer_id)
            killer = threading.Timer(0.15, victim.kill_group)  # mid-step: 472 tokens take 4 slow passes
            killer.start()
            outputs = session.step(hidden[:, 8:])
            killer.join()
            assert session.num_failovers == 1
    reasons = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert any("closed the stream" in reason for reason in reasons), reasons  # not "did not reply within"
    torch.testing.assert_close(outputs, expected, rtol=1e-4, atol=1e-4)
    restore(replicated, victim)


def test_sigterm_drains_open_sessions_and_sends_new_ones_elsewhere(tiny_models, replicated, expected):
    with connect(tiny_models["llama"], replicated) as model:
        routes: list = []
        with model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS) as session:
            victim = []

            def on_token(_):
                if not routes and session.position >= PROMPT.shape[1] + NEW_TOKENS // 2:
                    first = session.route[0].peer_id
                    server = next(s for s in replicated.servers if s.peer_id == first)
                    server.signal(signal.SIGTERM)
                    victim.append(server)
                    with model.inference_session(
                        max_length=PROMPT.shape[1] + 4
                    ) as other:  # a new session now
                        model.generate(PROMPT, session=other, max_new_tokens=4)
                        routes.append([hop.peer_id for hop in other.route])

            tokens = model.generate(PROMPT, session=session, max_new_tokens=NEW_TOKENS, streamer=on_token)
            assert session.num_failovers == 0  # the draining server finished our session
        (server,) = victim
        assert server.peer_id not in routes[0]
    assert torch.equal(tokens, expected)
    assert server.popen.wait(timeout=60) == 0  # the session ended, so the drain ended
    assert "draining open ones" in server.log()
    server.kill_group()
    restore(replicated, server)
