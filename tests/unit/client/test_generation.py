"""The generation loop over corolla's own servers in this process (tests/loopback.py): a server killed at
any hop in the middle of a generation, plain or speculative (or frozen with pipelined frames in flight),
changes no token; a speculative round that accepts only part of its tree keeps exactly the path the
model chose; a session continues a conversation where the last call stopped."""

from __future__ import annotations

import time

import pytest
import torch

from corolla.config import SpeculationConfig
from loopback import LoopbackSwarm
from swarm_helpers import reference_generate

NEW_TOKENS = 24
CHAIN = [(0, 2), (2, 4), (4, 6)]


def repetitive_prompt(seed: int) -> torch.Tensor:
    """Random tokens with a repeated stretch, so that prompt lookup finds matches."""
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(seed))
    return torch.cat([ids, ids[:, :6], ids], dim=1)


@pytest.fixture(scope="module")
def prompt():
    return repetitive_prompt(3)


@pytest.fixture(scope="module")
def expected(reference, prompt):
    return reference_generate(reference, prompt, max_new_tokens=NEW_TOKENS)


def generate_with_a_death(swarm, model, prompt, hop: int, freeze: bool = False) -> torch.Tensor:
    """Greedy generation over the three-hop chain; halfway through, replicas join and the server of `hop`
    dies with the next step in hand (`freeze`: hangs instead, taking requests and never answering)."""
    with model.inference_session(prompt.shape[1] + NEW_TOKENS) as session:
        chosen, victims = [], []

        def on_token(_):
            chosen.append(1)
            if len(chosen) == NEW_TOKENS // 2:
                swarm.add_server((0, 3))
                swarm.add_server((3, 6))
                victims.append(swarm.network.servers[session.route[hop].peer_id])
                if freeze:
                    swarm.runtime.loop.call_soon_threadsafe(victims[0].freeze)
                else:
                    victims[0].dies_at_step = victims[0].steps_received + 1

        tokens = model.generate(prompt, session=session, max_new_tokens=NEW_TOKENS, streamer=on_token)
        assert session.num_failovers == 1 and (freeze or not victims[0].alive)
        assert victims[0].peer_id not in {h.peer_id for h in session.route}
    return tokens  # (a frozen server is stopped with the swarm)


@pytest.mark.parametrize("hop", [0, 1, 2], ids=["first", "middle", "last"])
def test_a_generation_survives_a_server_killed_at_any_hop(llama, prompt, expected, hop):
    with LoopbackSwarm(llama, CHAIN) as swarm:
        assert torch.equal(generate_with_a_death(swarm, swarm.model(), prompt, hop), expected)


def test_a_speculating_generation_survives_a_killed_server(llama, prompt, expected):
    """The middle server dies while the session speculates with draft trees (the tiny model drafting for
    itself: deep trees, mostly accepted): its replacement gets the kept path replayed (never a tree), the
    tree in flight is verified again there, and the tokens are those of plain decoding."""
    speculation = SpeculationConfig(draft=str(llama), width=2, max_depth=4, adaptive=False)
    with LoopbackSwarm(llama, CHAIN) as swarm:
        model = swarm.model(speculation=speculation)
        assert torch.equal(generate_with_a_death(swarm, model, prompt, 1), expected)
        assert model.speculator.stats.tokens_per_step > 2


@pytest.mark.parametrize("hop", [0, 1, 2], ids=["first", "middle", "last"])
def test_pipelined_speculation_survives_a_server_killed_with_frames_in_flight(llama, prompt, expected, hop):
    """The session keeps up to 3 drafted chains in flight (the tiny model drafting for itself: each mostly
    accepted); a server dies with a frame in hand: what was verified stays, the frames after it are
    dropped, a synchronous step replaces the server from the histories, and the tokens are those of plain
    decoding."""
    speculation = SpeculationConfig(draft=str(llama), max_depth=3, adaptive=False)
    with LoopbackSwarm(llama, CHAIN) as swarm:
        model = swarm.model(speculation=speculation)
        assert torch.equal(generate_with_a_death(swarm, model, prompt, hop), expected)
        assert model.speculator.stats.accepted > 0


@pytest.mark.parametrize("hop", [0, 2], ids=["first", "last"])
def test_pipelined_speculation_replaces_a_server_frozen_with_frames_in_flight(llama, prompt, expected, hop):
    """A server hangs with frames in flight (takes them, never answers, misses pings): the pipe ends when a
    frame has waited its pace and a ping, the next step fails over at once (no second wait), and the
    tokens are plain decoding's, long before the request timeout."""
    speculation = SpeculationConfig(draft=str(llama), max_depth=3, adaptive=False)
    with LoopbackSwarm(llama, CHAIN) as swarm:
        model = swarm.model(speculation=speculation, request_timeout=120.0)
        started = time.monotonic()
        assert torch.equal(generate_with_a_death(swarm, model, prompt, hop, freeze=True), expected)
        assert time.monotonic() - started < 60.0  # not the request timeout's 120 s


def test_a_round_that_accepts_part_of_its_tree_keeps_the_models_own_path(llama, reference):
    """A draft model that is NOT the target (another random checkpoint of the same shapes) drafts trees
    the target mostly rejects: each round keeps only the accepted part (and the model's own next token),
    and the text is the target's greedy text."""
    prompt = repetitive_prompt(4)
    expected = reference_generate(reference, prompt, max_new_tokens=NEW_TOKENS)
    other = llama.parent / "tiny-llama-other-weights"
    if not other.exists():
        from tiny_models import save_tiny_model

        save_tiny_model("llama", other, seed=1)
    speculation = SpeculationConfig(draft=str(other), width=2, max_depth=3, adaptive=False)
    with LoopbackSwarm(llama, [(0, 6)]) as swarm:
        model = swarm.model(speculation=speculation)
        assert torch.equal(model.generate(prompt, max_new_tokens=NEW_TOKENS), expected)
        stats = model.speculator.stats
        assert stats.drafted > stats.accepted  # trees were cut: part accepted, part dropped
        for server in swarm.servers:  # the servers hold exactly the text's cache: nothing of the trees
            assert server.status.snapshot().num_sessions == 0


def test_a_session_continues_a_conversation_without_recomputing_it(llama, reference):
    """Two calls on one session: the second continues after the first's last chosen token, which the
    session keeps pending (never sent twice), exactly as one long greedy generation would."""
    first = torch.randint(3, 300, (1, 10), generator=torch.Generator().manual_seed(6))
    second = torch.randint(3, 300, (1, 5), generator=torch.Generator().manual_seed(7))
    with LoopbackSwarm(llama, CHAIN) as swarm:
        model = swarm.model()
        with model.inference_session(max_length=64) as session:
            answer = model.generate(first, session=session, max_new_tokens=6)
            assert session.position == first.shape[1] + 5  # the last chosen token is not fed yet
            assert torch.equal(session.pending_token_ids, answer[:, -1:])
            sent = [server.steps_received for server in swarm.servers]
            more = model.generate(second, session=session, max_new_tokens=6)
            assert [s.steps_received - n for s, n in zip(swarm.servers, sent, strict=True)] == [6] * 3
    history = torch.cat([answer, second], dim=1)  # the whole conversation: one greedy generation's tokens
    assert torch.equal(more[:, -6:], reference_generate(reference, history, max_new_tokens=6)[:, -6:])
