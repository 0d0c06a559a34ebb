"""Every supported family served by a chain of two of corolla's own servers in this process
(tests/loopback.py): greedy tokens, the hidden states at the block boundary and after the last block,
logits, the loss and its gradients are transformers' own, alone and as eight sessions running at once (so
that the servers batch their steps)."""

from __future__ import annotations

import pytest
import torch

from loopback import LoopbackSwarm, generate_together
from swarm_helpers import reference_generate
from tiny_models import FAMILIES, hidden_states, load_reference

NEW_TOKENS = 8
SPANS = [(0, 3), (3, 6)]
SOLO = (0, 7)  # the prompts also generated alone (each batched one is checked against transformers)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_models):
    """A swarm of two servers of one tiny family, and transformers' model of it."""
    path = tiny_models[request.param]
    with LoopbackSwarm(path, SPANS) as swarm:
        yield swarm, load_reference(path)


def test_greedy_tokens_alone_and_in_batched_sessions_are_transformers_tokens(family):
    swarm, reference = family
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 300, (1, 4 + i), generator=generator) for i in range(8)]
    expected = [reference_generate(reference, ids, max_new_tokens=NEW_TOKENS) for ids in prompts]
    model = swarm.model()
    for index in SOLO:  # alone: the shortest and the longest prompt
        solo = model.generate(prompts[index], max_new_tokens=NEW_TOKENS)
        assert torch.equal(solo, expected[index]), f"prompt {index}: solo differs from transformers"
    batched, held = model.runtime.run(generate_together(model, swarm.servers, prompts, NEW_TOKENS))
    assert held == [len(prompts)] * len(SPANS)  # the servers ran the eight sessions together
    for index, (want, together) in enumerate(zip(expected, batched, strict=True)):
        assert torch.equal(together, want), f"prompt {index}: batched differs from transformers"
    assert all(server.status.snapshot().num_sessions == 0 for server in swarm.servers)


def test_a_later_turn_forked_from_the_first_gives_transformers_tokens(family):
    """Reused prefixes in every family: turn 2 starts from what turn 1 left on the servers (pages shared,
    or, for spans with recurrent states, recomputed there from the kept inputs), never sent again."""
    swarm, reference = family
    turn1 = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(9))
    model = swarm.model()
    out1 = model.generate(turn1, max_new_tokens=NEW_TOKENS)
    turn2 = torch.cat(
        [out1, torch.randint(3, 300, (1, 5), generator=torch.Generator().manual_seed(10))], dim=1
    )
    out2 = model.generate(turn2, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out2, reference_generate(reference, turn2, max_new_tokens=NEW_TOKENS))
    stats = model.client.prefixes.stats
    assert stats.hits == 1 and stats.reused_tokens == out1.shape[1] - 1


def test_block_boundaries_and_logits_are_transformers_hidden_states(family):
    swarm, reference = family
    input_ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(8))
    expected = hidden_states(reference, input_ids)
    model = swarm.model()
    with model.inference_session(max_length=16) as session:
        outputs = session.step(model.head.embed(input_ids))
        assert [(hop.start, hop.end) for hop in session.route] == SPANS
        boundary = session.chain.links[1].history.inputs  # what the first server sent the second
    boundary, _ = model.head.wire.unpack(boundary)  # beside it, Gemma's per-layer inputs (models/handoff.py)
    torch.testing.assert_close(boundary, expected[3], atol=1e-4, rtol=1e-4)
    if model.head.wire.streams == 1:  # transformers records Gemma 3n's last streams before it merges them
        last, _ = model.head.wire.unpack(outputs)  # (ZAYA: without the router state handed on)
        torch.testing.assert_close(model.head.norm(last), expected[6], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        expected_logits = reference(input_ids).logits
    torch.testing.assert_close(model(input_ids).logits, expected_logits, atol=1e-4, rtol=1e-4)


def test_the_loss_and_its_gradients_through_the_servers_are_local_autograds(family):
    swarm, reference = family
    input_ids = torch.randint(3, 300, (2, 7), generator=torch.Generator().manual_seed(9))
    model = swarm.model()
    model.head.requires_grad_(True)  # gradients flow back through both servers to the embeddings
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    reference.zero_grad(set_to_none=True)
    expected = reference(input_ids, labels=input_ids).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=0)
    grad = model.head.embed_tokens.weight.grad
    assert grad.abs().sum() > 0
    torch.testing.assert_close(grad, reference.get_input_embeddings().weight.grad, atol=1e-4, rtol=1e-3)
    reference.zero_grad(set_to_none=True)
