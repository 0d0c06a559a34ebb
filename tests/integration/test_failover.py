"""Servers die mid-generation (SIGKILL to the whole process group, as when a machine vanishes); the
client routes around them, replays what the dead server had received to a replica, and the generation
finishes with exactly the tokens of an uninterrupted run."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from corolla.config import SpeculationConfig
from corolla.errors import MissingBlocks
from corolla.launch.local import LocalSwarm
from swarm_helpers import connect

SPANS = [(0, 10), (10, 20), (20, 30)]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def replicated_swarm(smollm2_path):
    """Two servers for each third of SmolLM2."""
    with LocalSwarm(str(smollm2_path), SPANS + SPANS, server_args=["--announce-period", "2"]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def prompt(smollm2_path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short poem about the sea."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def expected(smollm2_path, replicated_swarm, prompt) -> torch.Tensor:
    """The uninterrupted generation that every interrupted one must reproduce."""
    with connect(smollm2_path, replicated_swarm) as model:
        tokens, *_ = generate_with_kill(model, replicated_swarm, prompt, hop=None)
    return tokens


def generate_with_kill(model, swarm: LocalSwarm, prompt: list[int], hop: int | None):
    """Greedy generation; halfway through, SIGKILL the server serving `hop` of the chain (None: no kill)."""
    stamps: list[float] = []
    killed: list = []
    with model.inference_session(max_length=len(prompt) + NEW_TOKENS) as session:

        def on_token(_):
            stamps.append(time.perf_counter())
            if hop is not None and len(stamps) == NEW_TOKENS // 2:
                victim = next(s for s in swarm.servers if s.peer_id == session.route[hop].peer_id)
                victim.kill_group()
                killed.append(victim)

        tokens = model.generate(
            prompt, session=session, max_new_tokens=NEW_TOKENS, ignore_eos=True, streamer=on_token
        )
        failovers = session.num_failovers
    return tokens, stamps, killed, failovers


@pytest.mark.parametrize("hop", [1, 0, 2], ids=["middle", "first", "last"])
def test_generation_survives_a_killed_server(smollm2_path, replicated_swarm, prompt, expected, hop):
    with connect(smollm2_path, replicated_swarm) as model:
        tokens, stamps, killed, failovers = generate_with_kill(model, replicated_swarm, prompt, hop=hop)
    assert torch.equal(tokens, expected)
    assert failovers == 1 and len(killed) == 1
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    stall = gaps[NEW_TOKENS // 2 - 1]
    print(f"hop {hop}: stall {stall:.2f}s against a median step of {sorted(gaps)[len(gaps) // 2]:.3f}s")
    assert stall < 10
    (victim,) = killed  # bring the swarm back to two replicas per span for the next test
    replicated_swarm.servers.remove(victim)
    replicated_swarm.add_server(victim.blocks, extra_args=["--announce-period", "2"])


def test_speculative_generation_survives_a_killed_server(smollm2_path, replicated_swarm, prompt, expected):
    """The middle server dies while a session speculates with draft trees: its replacement gets the kept
    path replayed (never a tree), the tree in flight is verified again there, and the tokens are those
    of plain decoding."""
    speculation = SpeculationConfig(draft="smollm2", quantize="int8", width=2, max_depth=4, adaptive=False)
    with connect(smollm2_path, replicated_swarm, speculation=speculation) as model:
        tokens, _, killed, failovers = generate_with_kill(model, replicated_swarm, prompt, hop=1)
        assert model.speculator.stats.tokens_per_step > 1.5
    assert torch.equal(tokens, expected)
    assert failovers == 1 and len(killed) == 1
    (victim,) = killed
    replicated_swarm.servers.remove(victim)
    replicated_swarm.add_server(victim.blocks, extra_args=["--announce-period", "2"])


def test_a_server_killed_while_it_computes_a_step_is_replaced_at_once(smollm2_path, replicated_swarm):
    """The first server dies in the middle of a long prefill step: the end of its stream, not the request
    timeout, tells the client, which replays the step on a replica (the same outputs)."""
    ids = torch.randint(100, 10_000, (1, 1024), generator=torch.Generator().manual_seed(0))
    with connect(smollm2_path, replicated_swarm, request_timeout=60.0) as model:
        hidden = model.head.embed(ids)
        with model.inference_session(max_length=ids.shape[1]) as session:
            session.step(hidden[:, :8])
            expected = session.step(hidden[:, 8:])
        with model.inference_session(max_length=ids.shape[1]) as session:
            session.step(hidden[:, :8])  # the route is chosen, the streams are open
            victim = next(s for s in replicated_swarm.servers if s.peer_id == session.route[0].peer_id)
            killer = threading.Timer(0.5, victim.kill_group)
            killer.start()
            started = time.monotonic()
            outputs = session.step(hidden[:, 8:])
            elapsed = time.monotonic() - started
            killer.join()
            assert session.num_failovers == 1
    print(f"long step with its first server killed after 0.5s: {elapsed:.1f}s")
    assert elapsed < 30.0  # half the request timeout; it took the whole timeout before
    torch.testing.assert_close(outputs, expected, rtol=0, atol=1e-4)
    replicated_swarm.servers.remove(victim)
    replicated_swarm.add_server(victim.blocks, extra_args=["--announce-period", "2"])


def test_without_a_replica_the_client_names_the_missing_blocks(smollm2_path, replicated_swarm, prompt):
    with connect(smollm2_path, replicated_swarm, routing_timeout=3.0) as model:
        victims = [s for s in replicated_swarm.servers if s.blocks == (10, 20)]
        for victim in victims:
            victim.kill_group()
            replicated_swarm.servers.remove(victim)
        started = time.monotonic()
        with pytest.raises(MissingBlocks, match="no server available for blocks 10-19") as info:
            model.generate(prompt, max_new_tokens=4)
        assert info.value.blocks == tuple(range(10, 20))
        assert time.monotonic() - started < 3.0 + 5.0  # the routing timeout, plus one DHT read
        for victim in victims:
            replicated_swarm.add_server(victim.blocks, extra_args=["--announce-period", "2"])
        assert model.generate(prompt, max_new_tokens=4).shape[1] == len(prompt) + 4


def test_sigterm_drains_open_sessions_and_sends_new_ones_elsewhere(
    smollm2_path, replicated_swarm, prompt, expected
):
    with connect(smollm2_path, replicated_swarm) as model:
        routes: list = []
        with model.inference_session(max_length=len(prompt) + NEW_TOKENS) as session:
            victim = []

            def on_token(_):
                if len(routes) == 0 and session.position >= len(prompt) + NEW_TOKENS // 2:
                    middle = session.route[1].peer_id
                    server = next(s for s in replicated_swarm.servers if s.peer_id == middle)
                    server.signal(signal.SIGTERM)
                    victim.append(server)
                    with model.inference_session(max_length=len(prompt) + 4) as other:  # a new session now
                        model.generate(prompt, session=other, max_new_tokens=4)
                        routes.append([hop.peer_id for hop in other.route])

            tokens = model.generate(
                prompt, session=session, max_new_tokens=NEW_TOKENS, ignore_eos=True, streamer=on_token
            )
            assert session.num_failovers == 0  # the draining server finished our session
        (server,) = victim
        assert server.peer_id not in routes[0]
    assert torch.equal(tokens, expected)
    assert server.popen.wait(timeout=30) == 0  # the session ended, so the drain ended
    assert "draining open ones" in server.log()
    server.kill_group()
    replicated_swarm.servers.remove(server)
    replicated_swarm.add_server(server.blocks, extra_args=["--announce-period", "2"])
