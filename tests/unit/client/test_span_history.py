"""A span session remembers exactly the inputs its server's cache was built from (for replays), and the
outputs it replied for them (for spot checks), through rollbacks, beam reordering and rewinds."""

import torch

from corolla.client.span_session import SpanSession
from corolla.swarm.routing import Hop


def session() -> SpanSession:
    return SpanSession(
        p2p=None, hop=Hop("peer", 0, 4), dht_prefix="m", max_length=64, timeout=1.0, keep_outputs=True
    )


def remember(span, hidden, position, prompts=None, hypo=None):
    span._remember(hidden, -hidden, prompts, hypo, position)  # outputs: anything told apart from inputs


def test_history_follows_steps_rollbacks_and_beam_reordering():
    span = session()
    a, b, c, d = (torch.randn(2, n, 8) for n in (3, 1, 2, 1))
    remember(span, a, 0)
    remember(span, b, 3)
    assert torch.equal(span.inputs, torch.cat([a, b], dim=1))
    span.verified = 4  # a spot check passed everything so far
    remember(span, c, 2)  # rolled back to position 2, then 2 new tokens
    assert torch.equal(span.inputs, torch.cat([a[:, :2], c], dim=1)) and span.verified == 2
    hypo = torch.tensor([1, 1])
    remember(span, d, 4, torch.ones(4, 2, 1, 8), hypo)  # both rows continue from row 1
    expected = torch.cat([torch.cat([a[:, :2], c], dim=1)[hypo], d], dim=1)
    assert torch.equal(span.inputs, expected) and span.prompts.shape == (4, 2, 1, 8)
    assert torch.equal(span.outputs, -expected)  # the outputs follow the inputs
    span.rewind(3)  # a spot check found position 3 wrong
    assert torch.equal(span.inputs, expected[:, :3]) and torch.equal(span.outputs, -expected[:, :3])
    remember(span, torch.randn(2, 2, 8), 0)  # a full restart keeps only the new tokens
    assert span.inputs.shape == span.outputs.shape == (2, 2, 8) and span.verified == 0


def test_a_tree_step_keeps_the_accepted_paths_inputs_and_outputs():
    span = session()
    prefix, tree = torch.randn(1, 2, 8), torch.randn(1, 4, 8)
    remember(span, prefix, 0)
    remember(span, tree, 2)
    span.tree = (2, None)
    span.accept((0, 2))  # tree nodes 0 and 2, a path
    kept = torch.cat([prefix, tree[:, [0, 2]]], dim=1)
    assert torch.equal(span.inputs, kept) and torch.equal(span.outputs, -kept)
