"""Spot checks' pure logic: the comparison, the schedule, a generation's rewind to its first wrong token."""

from __future__ import annotations

import torch

from corolla.client.generation import Chooser, RowEnds
from corolla.client.sampling import SamplingParams
from corolla.client.spot_checks import TOLERANCE, SpotChecker, deviation, first_wrong


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
