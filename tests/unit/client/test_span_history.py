"""A span session remembers exactly the inputs its server's cache was built from (for replays)."""

import torch

from corolla.client.span_session import SpanSession
from corolla.swarm.routing import Hop


def session() -> SpanSession:
    return SpanSession(p2p=None, hop=Hop("peer", 0, 4), dht_prefix="m", max_length=64, timeout=1.0)


def test_history_follows_steps_rollbacks_and_beam_reordering():
    span = session()
    a, b, c, d = (torch.randn(2, n, 8) for n in (3, 1, 2, 1))
    span._remember(a, None, None, 0)
    span._remember(b, None, None, 3)
    assert torch.equal(span.inputs, torch.cat([a, b], dim=1))
    span._remember(c, None, None, 2)  # rolled back to position 2, then 2 new tokens
    assert torch.equal(span.inputs, torch.cat([a[:, :2], c], dim=1))
    hypo = torch.tensor([1, 1])
    span._remember(d, torch.ones(4, 2, 1, 8), hypo, 4)  # both rows continue from row 1
    expected = torch.cat([torch.cat([a[:, :2], c], dim=1)[hypo], d], dim=1)
    assert torch.equal(span.inputs, expected) and span.prompts.shape == (4, 2, 1, 8)
    span._remember(torch.randn(2, 2, 8), None, None, 0)  # a full restart keeps only the new tokens
    assert span.inputs.shape == (2, 2, 8)
