"""Bans: one failure counts once however many sessions saw it, a server that comes back is reinstated,
and a liar next to one honest replica gets no one reported (real servers in this process,
tests/loopback.py) until a third server settles it."""

from __future__ import annotations

import logging

import pytest
import torch

from corolla.client.routing.bans import FULL_TIME, Bans, Undecided
from corolla.config import ClientConfig, EngineConfig
from corolla.errors import CacheExhausted, MissingBlocks, ServerUnavailable
from loopback import LoopbackSwarm
from swarm_helpers import reference_generate

PROMPT = torch.tensor([[1, 5, 9, 22, 7, 31, 4]])
NEW_TOKENS = 24


def test_one_failure_seen_by_many_sessions_counts_once(caplog):
    bans = Bans(ClientConfig(ban_time=15.0))
    with caplog.at_level(logging.INFO, logger="corolla.client.routing.bans"):
        for _ in range(5):  # five sessions were on the server when it died
            bans.ban("peer-A")
    assert bans.banned() == {"peer-A"}
    avoiding = [r.getMessage() for r in caplog.records if "Avoiding" in r.getMessage()]
    assert avoiding == ["Avoiding server ...peer-A for 15s after a failure"]


def test_an_avoided_server_that_comes_back_is_reinstated():
    bans = Bans(ClientConfig(ban_time=60.0))
    bans.ban("peer-A")
    bans.pinged("peer-A", True)  # still answers pings (but failed a step): stays avoided
    assert "peer-A" in bans.banned()
    bans.pinged("peer-A", False)  # gone...
    assert "peer-A" in bans.banned()
    bans.pinged("peer-A", True)  # ...and back (restarted, or resumed)
    assert bans.banned() == set()
    bans.ban("peer-A")  # a fresh process: its failures start again from one
    assert bans.avoided() == {"peer-A"}


def test_a_server_out_of_cache_is_passed_over_for_a_while_not_banned():
    now = [100.0]
    bans = Bans(ClientConfig(ban_time=15.0), clock=lambda: now[0])
    bans.failed("peer-A", CacheExhausted("no cache"))
    assert bans.banned() == bans.out_of_cache() == {"peer-A"} and bans.avoided() == set()
    now[0] += FULL_TIME
    assert bans.banned() == set()
    bans.failed("peer-A", ServerUnavailable("gone"))  # a real failure is its first: ban_time, not doubled
    assert bans.avoided() == {"peer-A"}
    now[0] += 15.0
    assert bans.banned() == set()


def test_a_session_a_full_server_refuses_goes_on_a_replica_exactly(llama, reference):
    """The server routing prefers (timed faster) has cache for 16 tokens only: the session's prompt fails
    there with CacheExhausted, the client replays it on the replica without banning the full server."""
    with LoopbackSwarm(llama, [(0, 6)]) as swarm:
        full = swarm.add_server((0, 6), engine=EngineConfig(max_cache_tokens=16, page_size=4))
        model = swarm.model()
        model.client.swarm.estimates.observed.update({full.peer_id: 0.001, swarm.servers[0].peer_id: 1.0})
        out = model.generate(PROMPT.repeat(1, 3), max_new_tokens=NEW_TOKENS)
        assert torch.equal(out, reference_generate(reference, PROMPT.repeat(1, 3), max_new_tokens=NEW_TOKENS))
        bans = model.client.swarm.bans
        assert full.peer_id in bans.out_of_cache() and full.peer_id not in bans.avoided()


def test_an_undecided_dispute_avoids_both_sides_and_accuses_neither():
    bans = Bans(ClientConfig())
    undecided = Undecided("peer-S", ("peer-A",), 15, 30)
    bans.dispute(undecided)
    assert bans.banned() == {"peer-S", "peer-A"} and bans.faulty == {}
    assert "a dispute between ...peer-S and ...peer-A over blocks 15:30 is undecided" in bans.explain(0, 20)
    assert bans.explain(0, 15) == ""
    bans.settle(undecided)
    assert bans.banned() == set()


@pytest.fixture
def one_replica(llama):
    with LoopbackSwarm(llama, [(0, 6)]) as swarm:
        yield swarm


def test_a_liar_next_to_one_honest_replica_gets_no_one_reported(one_replica, reference):
    honest = one_replica.servers[0]
    liar = one_replica.add_server((0, 6), fault="wrong-weights")
    model = one_replica.model("client", spot_checks=0.1, routing_timeout=1.0)
    model.client.swarm.estimates.observe_step(honest.peer_id, 1.0, 6)
    model.client.swarm.estimates.observe_step(liar.peer_id, 0.01, 6)  # routed through the liar
    with pytest.raises(MissingBlocks, match=r"dispute between .* over blocks 0:6 is undecided") as caught:
        model.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert liar.peer_id[-6:] in str(caught.value) and honest.peer_id[-6:] in str(caught.value)
    bans = model.client.swarm.bans
    assert bans.faulty == {} and "client" not in one_replica.network.reports
    # servers of parts of those blocks join: they settle it, and only the liar is reported
    one_replica.add_server((0, 3))
    one_replica.add_server((3, 6))
    tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert torch.equal(tokens, reference_generate(reference, PROMPT, max_new_tokens=NEW_TOKENS))
    assert set(bans.faulty) == {liar.peer_id} and bans.undecided == []
    assert set(one_replica.network.reports["client"]) == {liar.peer_id}


def test_a_killed_server_that_restarts_is_used_again(one_replica):
    server = one_replica.servers[0]
    swarm = one_replica.model("client").client.swarm

    async def refresh_and_probe() -> None:
        await swarm.view.refresh()
        probing = getattr(swarm.view, "_probing", None)  # avoided servers are pinged in the background
        if probing is not None:
            await probing

    one_replica.runtime.run(refresh_and_probe())
    server.kill()
    swarm.bans.ban(server.peer_id)  # (its sessions failed)
    one_replica.runtime.run(refresh_and_probe())  # avoided servers are pinged too: this one is gone
    assert server.peer_id in swarm.bans.banned()
    server.alive = True  # restarted with the same identity
    one_replica.runtime.run(refresh_and_probe())
    assert server.peer_id not in swarm.bans.banned()
