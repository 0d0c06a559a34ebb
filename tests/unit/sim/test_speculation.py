"""The projection of one session's speculation through a chain (sim/speculation.py): synchronous rounds
priced exactly, pipelined frames against what a pipeline's bounds say, seeded runs repeated, and the
bundled scenario's classes projected."""

from __future__ import annotations

import pytest

from corolla.sim.compute import PassCost
from corolla.sim.scenario import load
from corolla.sim.speculation import Drafting, Hop, pipelined_rate, project, synchronous, synchronous_rate


def chain(hops: int, one_way: float, per_block: float = 0.001, blocks: int = 10) -> list[Hop]:
    return [Hop(blocks, PassCost(per_block, 0.0), one_way, one_way, one_way, 0.0) for _ in range(hops)]


def test_a_synchronous_round_costs_its_draft_the_pushed_chain_and_the_way_back():
    hops = chain(3, 0.025)
    tokens, seconds = synchronous(hops, Drafting(0.5, 0.01), 2)
    assert tokens == pytest.approx(1 + 0.5 + 0.25)
    # 2 drafted tokens, to the first hop, three passes of 10 ms, two pushes and the way back
    assert seconds == pytest.approx(0.02 + 0.025 + 3 * 0.01 + 2 * 0.025 + 0.025)
    plain, depth = synchronous_rate(hops, Drafting(0.0, 0.01))
    assert depth == 0 and plain == pytest.approx(1 / (4 * 0.025 + 3 * 0.01))  # no draft pays: plain


def test_pipelined_frames_keep_the_chain_busy_up_to_their_bound_in_flight():
    """Drafts that are always right and cost nothing: `depth` frames of `k` tokens per round trip of a
    frame (the chain is far from busy): twice what synchronous rounds of 1 + k tokens give."""
    hops = chain(3, 0.025)
    drafting = Drafting(0.999, 0.0)
    frame_seconds = 4 * 0.025 + 3 * 0.01  # a frame's trip: pushes, passes (of one block's fixed cost)
    rate = pipelined_rate(hops, drafting, frame=2, depth=3, seed=1)
    assert rate == pytest.approx(3 * 2 / frame_seconds, rel=0.1)
    sync_tokens, sync_seconds = synchronous(hops, drafting, 2)
    assert rate > 1.8 * sync_tokens / sync_seconds  # 6 tokens a trip, not 3


def test_drafts_that_are_always_wrong_give_no_more_than_plain_decoding_and_pushed_rollbacks_pay():
    hops = chain(6, 0.04)
    drafting = Drafting(0.0, 0.001)
    plain = 1 / synchronous(hops, drafting, 0)[1]
    pushed = pipelined_rate(hops, drafting, frame=2, depth=3, seed=2)
    unpushed = pipelined_rate(hops, drafting, frame=2, depth=3, seed=2, pushed_rollbacks=False)
    assert unpushed < pushed <= 1.01 * plain
    # a rollback through the client pays a round trip to it at every hop: dearer than a pushed one
    good = Drafting(0.8, 0.005)
    assert pipelined_rate(hops, good, 3, 3, seed=3) > pipelined_rate(
        hops, good, 3, 3, 3, pushed_rollbacks=False
    )


def test_a_seeded_projection_repeats_and_names_every_class():
    scenario = load("crash10")
    first = project(scenario, Drafting(0.8, 0.005), depth=3, chains=2)
    assert project(scenario, Drafting(0.8, 0.005), depth=3, chains=2) == first
    assert set(first["classes"]) == {kind.name for kind in scenario.classes}
    h100 = first["classes"]["h100"]
    assert h100["hops"] == 3  # 80 blocks, 35 a server
    assert h100["synchronous_tokens_per_s"] > h100["plain_tokens_per_s"] > 0
