"""A hop's history holds exactly the inputs its server's cache was built from (for replays), and the
outputs it replied for them (for spot checks), through rollbacks, beam reordering, trees and rewinds."""

import torch

from corolla.client.chain.hop_history import HopHistory
from corolla.client.rpc.span_stream import Step


def record(history, hidden, position, prompts=None, hypo=None, tree=None):
    history.record(Step(hidden, position, prompts, hypo, tree), -hidden)  # outputs: told apart from inputs


def test_history_follows_steps_rollbacks_and_beam_reordering():
    history = HopHistory(keep_outputs=True)
    a, b, c, d = (torch.randn(2, n, 8) for n in (3, 1, 2, 1))
    record(history, a, 0)
    record(history, b, 3)
    assert torch.equal(history.inputs, torch.cat([a, b], dim=1)) and history.length == 4
    record(history, c, 2)  # rolled back to position 2, then 2 new tokens
    assert torch.equal(history.inputs, torch.cat([a[:, :2], c], dim=1))
    hypo = torch.tensor([1, 1])
    record(history, d, 4, torch.ones(4, 2, 1, 8), hypo)  # both rows continue from row 1
    expected = torch.cat([torch.cat([a[:, :2], c], dim=1)[hypo], d], dim=1)
    assert torch.equal(history.inputs, expected) and history.prompts.shape == (4, 2, 1, 8)
    assert torch.equal(history.outputs, -expected)  # the outputs follow the inputs
    history.rewind(3)  # a spot check found position 3 wrong
    assert torch.equal(history.inputs, expected[:, :3]) and torch.equal(history.outputs, -expected[:, :3])
    record(history, torch.randn(2, 2, 8), 0)  # a full restart keeps only the new tokens
    assert history.inputs.shape == history.outputs.shape == (2, 2, 8)


def test_a_tree_step_keeps_the_accepted_paths_inputs_and_tells_the_next_step():
    history = HopHistory(keep_outputs=True)
    prefix, tree = torch.randn(1, 2, 8), torch.randn(1, 4, 8)
    record(history, prefix, 0)
    record(history, tree, 2, tree=(-1, 0, 0, 1))
    assert history.accepted_at(3) is None  # no path known yet
    history.accept((0, 2))  # tree nodes 0 and 2, a path
    kept = torch.cat([prefix, tree[:, [0, 2]]], dim=1)
    assert torch.equal(history.inputs, kept) and torch.equal(history.outputs, -kept)
    assert history.accepted_at(4) == (0, 2) and history.accepted_at(3) == (0,)  # a step there keeps it
    assert history.accepted_at(2) is None  # a step at the tree's start drops it whole
    record(history, torch.randn(1, 1, 8), 4)
    assert history.accepted_at(5) is None  # told once: the server holds no tree any more
