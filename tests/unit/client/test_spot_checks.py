"""Spot checks' pure logic: the comparison, the schedule, who is judged faulty, a generation's rewind to its
first wrong token."""

from __future__ import annotations

import asyncio

import torch

from corolla.decoding.chooser import Chooser, RowEnds
from corolla.decoding.sampling import SamplingParams
from corolla.client.spot_checks import (
    GRADIENT_TOLERANCE,
    TOLERANCE,
    Dispute,
    SpotChecker,
    deviation,
    first_wrong,
    gradients_agree,
    outputs_agree,
)
from corolla.swarm.routing import Hop


def test_deviation_is_relative_per_position():
    reference = torch.randn(2, 5, 16)
    assert torch.allclose(deviation(reference, reference), torch.zeros(2, 5))
    scaled = reference * 1.01  # 1% off everywhere
    assert torch.allclose(deviation(scaled, reference), torch.full((2, 5), 0.01), atol=1e-5)
    assert first_wrong(scaled, reference) is None
    wrong = reference.clone()
    wrong[1, 3] += reference[1, 3].norm() * 2 * TOLERANCE / 16**0.5  # one row, one position past it
    assert first_wrong(wrong, reference) == 3


def test_each_hop_is_checked_once_per_window():
    checker = SpotChecker(swarm=None, share=0.1, seed=1)
    assert checker.window == 10
    offsets = checker.offsets(3)
    assert len(offsets) == 3 and all(0 <= offset < 10 for offset in offsets)
    assert SpotChecker(swarm=None, share=0.0).offsets(3) == []


def chooser(do_sample: bool) -> Chooser:
    params = SamplingParams(max_new_tokens=8, do_sample=do_sample, temperature=1.0, seed=7, ignore_eos=True)
    return Chooser(params, RowEnds(params, [0], None, 1), 0, torch.tensor([[5, 6]]))


def test_a_rewound_chooser_chooses_the_same_tokens_again():
    logits = [torch.randn(1, 50, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    for do_sample in (False, True):
        first = chooser(do_sample)
        tokens = [int(first.choose(x).tokens) for x in logits]
        assert first.rewind(2) == 4  # 4 choices forgotten
        assert first.num_chosen == 2 and first.context.tolist() == [[5, 6, *tokens[:2]]]
        again = [int(first.choose(x).tokens) for x in logits[2:]]
        assert again == tokens[2:]  # the sampler's state went back with it


class Swarm:  # what the checker's verdicts touch of a swarm client: bans
    def __init__(self):
        self.faulty = {}

    def ban_for_good(self, peer_id, reason):
        self.faulty[peer_id] = reason


def judged(liar: str, chains: dict[frozenset, list[str]]) -> tuple[str, ...]:
    """The verdict on checked server S, checked by the chain A (blocks 0:3) + C (3:6), when the chain
    that avoids each set of servers is `chains[avoided]` (absent: none) and `liar` corrupts every chain
    it is in."""
    right, wrong = torch.ones(1, 4, 8), -torch.ones(1, 4, 8)

    def outcome(servers):
        return wrong if liar in servers else right

    async def elsewhere(hop, run, avoid):
        servers = chains.get(frozenset(avoid))
        return (None, []) if servers is None else (outcome(servers), servers)

    checker = SpotChecker(Swarm(), share=1.0)
    checker._elsewhere = elsewhere
    hop = Hop("S", 0, 6)
    result, reference = outcome(["S"]), outcome(["A", "C"])
    dispute = Dispute(hop, result, reference, ["A", "C"], None, outputs_agree)
    verdict = asyncio.run(checker._judge(dispute))
    assert set(checker.swarm.faulty) == set(verdict)
    return verdict


def test_a_disagreement_is_decided_by_other_chains_or_bans_both_sides():
    outside = {frozenset({"S", "A", "C"}): ["B"]}  # a server outside both chains
    assert judged("S", outside) == ("S",)
    assert judged("A", outside) == ("A", "C")  # the checkers' chain lied: a client cannot tell which
    # too few replicas for that: one chain per checker, avoiding it (and S)
    per_checker = {frozenset({"S", "A"}): ["B", "C"], frozenset({"S", "C"}): ["A"]}
    assert judged("S", per_checker) == ("S",)  # both agree with the checkers: every checker is cleared
    assert judged("A", per_checker) == ("A",)  # B + C agrees with S: A, which it avoided, lied
    assert judged("C", per_checker) == ("C",)
    assert judged("S", {frozenset({"S", "A"}): ["B", "C"]}) == ("S", "A", "C")  # C never cleared
    assert judged("S", {}) == ("S", "A", "C")


def test_gradients_are_compared_as_one_vector():
    reference = torch.randn(2, 5, 16)
    tiny = reference.clone()
    tiny[0, 2] = 1e-6  # a position whose gradient is nothing: relative to itself, any change is huge
    changed = tiny.clone()
    changed[0, 2] = 1e-3
    assert not outputs_agree(changed, tiny) and gradients_agree(changed, tiny)
    assert not gradients_agree(reference * (1 + 2 * GRADIENT_TOLERANCE), reference)
