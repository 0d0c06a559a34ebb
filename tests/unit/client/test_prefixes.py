"""Reused prefixes over corolla's own servers in this process (tests/loopback.py): a later turn of a chat,
n rows of one prompt and concurrent prompts sharing a system prompt start from what the servers hold
(forked sessions, engine/forks.py), send and compute only the rest, and give transformers' own tokens;
a server that lost the session it was to fork from just gets the prefix sent again."""

from __future__ import annotations

import asyncio

import pytest
import torch

from corolla.client.generation.prefixes import Prefix, PrefixCache
from corolla.config import SpeculationConfig
from loopback import LoopbackSwarm
from swarm_helpers import reference_generate

CHAIN = [(0, 3), (3, 6)]
NEW_TOKENS = 8


def random_ids(seed: int, length: int) -> torch.Tensor:
    return torch.randint(3, 300, (1, length), generator=torch.Generator().manual_seed(seed))


def engines(swarm: LoopbackSwarm) -> list:
    return [server.spans.primary.engine.engine for server in swarm.servers]


def computed(swarm: LoopbackSwarm) -> int:
    """Positions the first server ran through its span (every row)."""
    return engines(swarm)[0].computed_tokens


def next_turn(history: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.cat([history, random_ids(seed, 6)], dim=1)


def test_a_later_turn_sends_only_what_is_new_and_gives_the_same_tokens(llama, reference):
    turn1 = random_ids(1, 40)
    with LoopbackSwarm(llama, CHAIN) as swarm:
        model = swarm.model()
        out1 = model.generate(turn1, max_new_tokens=NEW_TOKENS)
        assert torch.equal(out1, reference_generate(reference, turn1, max_new_tokens=NEW_TOKENS))
        before = computed(swarm)
        turn2 = next_turn(out1, 2)
        out2 = model.generate(turn2, max_new_tokens=NEW_TOKENS)
        assert torch.equal(out2, reference_generate(reference, turn2, max_new_tokens=NEW_TOKENS))
        stats = model.client.prefixes.stats
        # the servers held turn 1 and all its answer but the last token (chosen, never fed)
        assert stats.hits == 1 and stats.reused_tokens == out1.shape[1] - 1
        new = turn2.shape[1] - stats.reused_tokens
        assert computed(swarm) - before == new + NEW_TOKENS - 1
        assert all(engine.forked_tokens == stats.reused_tokens for engine in engines(swarm))


def test_a_server_that_lost_the_prefix_gets_it_again(llama, reference):
    turn1 = random_ids(3, 40)
    with LoopbackSwarm(llama, CHAIN) as swarm:
        model = swarm.model()
        out1 = model.generate(turn1, max_new_tokens=NEW_TOKENS)
        last = engines(swarm)[1]
        evicted = swarm.runtime.run(_evict_all(swarm, last))
        assert evicted >= 1
        turn2 = next_turn(out1, 4)
        out2 = model.generate(turn2, max_new_tokens=NEW_TOKENS)
        assert torch.equal(out2, reference_generate(reference, turn2, max_new_tokens=NEW_TOKENS))
        assert engines(swarm)[0].forked_tokens > 0 and last.forked_tokens == 0
        assert not model.client.swarm.bans.banned()  # losing a kept session is no fault


async def _evict_all(swarm, engine) -> int:
    server = swarm.servers[1]

    def evict() -> int:
        count = len(engine.idle)
        while engine.idle.evict_one():
            pass
        return count

    return await server.spans.primary.engine.call(evict)


def test_n_rows_of_one_prompt_prefill_it_once(llama, reference):
    prompt = random_ids(5, 30)
    with LoopbackSwarm(llama, CHAIN) as swarm:
        model = swarm.model()
        out = model.generate(prompt.repeat(3, 1), max_new_tokens=NEW_TOKENS)
        expected = reference_generate(reference, prompt, max_new_tokens=NEW_TOKENS)
        assert all(torch.equal(row, expected[0]) for row in out)
        # the prompt but its last token once, then the last token and the new ones on 3 rows
        assert computed(swarm) == prompt.shape[1] - 1 + 3 * NEW_TOKENS


def test_concurrent_prompts_sharing_a_system_prompt_compute_it_once(llama, reference):
    system = random_ids(6, 48)
    prompts = [torch.cat([system, random_ids(10 + i, 5)], dim=1) for i in range(4)]
    with LoopbackSwarm(llama, CHAIN) as swarm:
        model = swarm.model()

        async def one(prompt):
            return [step.cached_tokens async for step in model.agenerate_steps(prompt, max_new_tokens=4)]

        async def together():
            return await asyncio.gather(*(one(p) for p in prompts))

        cached = swarm.runtime.run(together())
        firsts = sorted(steps[0] for steps in cached)
        assert firsts[0] == 0 and all(c >= system.shape[1] for c in firsts[1:])
        prefill = system.shape[1] + sum(p.shape[1] - system.shape[1] for p in prompts)
        assert computed(swarm) - 4 * 3 <= 1.1 * prefill
        for prompt in prompts:  # and reuse changes no token
            expected = reference_generate(reference, prompt, max_new_tokens=NEW_TOKENS)
            assert torch.equal(model.generate(prompt, max_new_tokens=NEW_TOKENS), expected)


@pytest.mark.parametrize("capacity", [0])
def test_reuse_can_be_turned_off(llama, capacity):
    prompt = random_ids(7, 30)
    with LoopbackSwarm(llama, CHAIN) as swarm:
        model = swarm.model(prefix_cache=capacity)
        model.generate(prompt, max_new_tokens=4)
        model.generate(prompt, max_new_tokens=4)
        assert model.client.prefixes is None
        assert all(engine.forked_tokens == 0 and not len(engine.idle) for engine in engines(swarm))


def test_reuse_composes_with_speculation(llama, reference):
    """Turn 1 speculates (its last step may leave a token tree on the servers: the fork starts before
    it), turn 2 forks it and speculates too: transformers' tokens both times."""
    speculation = SpeculationConfig(draft=str(llama), width=2, max_depth=4, adaptive=False)
    turn1 = torch.cat([random_ids(8, 20)] * 2, dim=1)
    with LoopbackSwarm(llama, CHAIN) as swarm:
        model = swarm.model(speculation=speculation)
        out1 = model.generate(turn1, max_new_tokens=NEW_TOKENS)
        assert torch.equal(out1, reference_generate(reference, turn1, max_new_tokens=NEW_TOKENS))
        turn2 = next_turn(out1, 9)
        out2 = model.generate(turn2, max_new_tokens=NEW_TOKENS)
        assert torch.equal(out2, reference_generate(reference, turn2, max_new_tokens=NEW_TOKENS))
        assert model.client.prefixes.stats.hits == 1 and model.speculator.stats.tokens_per_step > 1


def test_a_forked_session_is_spot_checked_like_any_other(llama, reference):
    """Every step checked against replicas: turn 2's fork (its copied prefix included) passes its checks,
    and nobody is accused."""
    turn1 = random_ids(11, 30)
    with LoopbackSwarm(llama, [(0, 6), (0, 3), (3, 6)]) as swarm:
        model = swarm.model(spot_checks=1.0)
        out1 = model.generate(turn1, max_new_tokens=NEW_TOKENS)
        turn2 = next_turn(out1, 12)
        out2 = model.generate(turn2, max_new_tokens=NEW_TOKENS)
        assert torch.equal(out2, reference_generate(reference, turn2, max_new_tokens=NEW_TOKENS))
        counts = model.client.checker.counts
        assert model.client.prefixes.stats.hits == 1
        assert (
            counts["failed"] == 0
            and counts["passed"] >= 2 * NEW_TOKENS
            and not model.client.swarm.bans.faulty
        )


async def test_a_prompt_waits_for_a_prefill_only_when_it_shares_most_of_it():
    """A prompt whose prefix another generation is prefilling waits for it when that is at least half of
    the prompt (a shared system prompt), not for a template's few tokens; then it takes the longest."""
    cache = PrefixCache()
    system = random_ids(13, 40)[0]
    running = Prefix(torch.cat([system, random_ids(14, 400)[0]]), session=None)
    ran = Prefix(system[:20], session=None)
    ran.ready.set()
    cache.entries += [running, ran]
    few = torch.cat([system[:24], random_ids(15, 40)[0]])  # 24 of 64 in common with the running one
    assert await asyncio.wait_for(cache.find(few), 1) == (ran, 20)  # at once: the ready one
    most = torch.cat([system, random_ids(16, 8)[0]])  # 40 of 48
    waiting = asyncio.ensure_future(cache.find(most))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    running.ready.set()
    assert await asyncio.wait_for(waiting, 1) == (running, 40)


def test_a_users_new_session_starts_from_the_servers_holding_its_prefix(llama, reference):
    """A session the user opened (on any of two replicas of each span) moves, at its first generation, to
    the servers that hold the longest prefix of its prompt; the conversation then goes on in it, exactly."""
    turn1 = random_ids(17, 30)
    with LoopbackSwarm(llama, [*CHAIN, *CHAIN]) as swarm:
        model = swarm.model()
        out1 = model.generate(turn1, max_new_tokens=NEW_TOKENS)
        (entry,) = model.client.prefixes.entries
        # replicas alike in time (on a loaded machine their timings drift past ALIKE; the trade-off when
        # they differ is the next test's)
        model.client.swarm.estimates.observed.update({server.peer_id: 0.1 for server in swarm.servers})
        turn2 = next_turn(out1, 18)
        with model.inference_session(turn2.shape[1] + 3 * NEW_TOKENS) as session:
            out2 = model.generate(turn2, session=session, max_new_tokens=NEW_TOKENS)
            assert session.route == entry.session.route
            turn3 = random_ids(19, 4)
            out3 = model.generate(turn3, session=session, max_new_tokens=NEW_TOKENS)
        whole = torch.cat([out2, out3[:, -(4 + NEW_TOKENS) :]], dim=1)
        expected = reference_generate(reference, turn2, max_new_tokens=NEW_TOKENS)
        assert torch.equal(out2, expected) and model.client.prefixes.stats.hits == 1
        assert torch.equal(
            whole, reference_generate(reference, whole[:, :-NEW_TOKENS], max_new_tokens=NEW_TOKENS)
        )


def test_a_prefix_on_a_slow_chain_is_reused_only_when_that_is_cheaper(llama, reference):
    """Routing's step-time estimates weigh it: the server holding a 40-token prefix, timed 1000x slower
    than a replica, is passed over (the 4 tokens this client's answers decode, on it, cost more than
    prefilling 40 tokens on the replica); timed fast, taken. Ties of the lookup go to the older entry."""
    system = random_ids(20, 40)
    with LoopbackSwarm(llama, [(0, 6), (0, 6)]) as swarm:
        model = swarm.model()
        observed = model.client.swarm.estimates.observed  # seconds per block of a decode step, as timed
        one, other = (server.peer_id for server in swarm.servers)
        observed.update({one: 0.001, other: 1.0})
        model.generate(torch.cat([system, random_ids(21, 4)], dim=1), max_new_tokens=4)
        holder = model.client.prefixes.entries[0].session.route[0].peer_id
        free = other if holder == one else one
        observed.update({holder: 1.0, free: 0.001})
        prompt = torch.cat([system, random_ids(22, 4)], dim=1)
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert torch.equal(out, reference_generate(reference, prompt, max_new_tokens=NEW_TOKENS))
        assert model.client.prefixes.stats.hits == 0
        observed.update({holder: 0.001, free: 1.0})
        prompt = torch.cat([system, random_ids(23, 4)], dim=1)
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert torch.equal(out, reference_generate(reference, prompt, max_new_tokens=NEW_TOKENS))
        assert model.client.prefixes.stats.hits == 1
