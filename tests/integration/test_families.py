"""Families beyond Llama's, each served by two real `corolla server` processes: greedy tokens, span
boundaries, forward passes and gradients equal transformers' own model, and 8 concurrent sessions batched
by the servers get exactly their solo tokens. (Llama, Mistral and Qwen2 get the same checks, over chains
of 1, 2 and 3 servers, in test_tiny_swarms and test_training.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from corolla.launch.local import LocalSwarm
from swarm_helpers import assert_boundaries_match, connect, reference_generate
from tiny_models import FAMILIES, LLAMA_LIKE, load_reference

OTHER_FAMILIES = [family for family in FAMILIES if family not in LLAMA_LIKE]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=OTHER_FAMILIES)
def family_chain(request, tiny_models):
    path = tiny_models[request.param]
    with LocalSwarm(str(path), [(0, 3), (3, 6)]) as swarm:
        yield path, swarm, load_reference(path)


def test_tokens_boundaries_and_batched_sessions_match_transformers(family_chain):
    path, swarm, reference = family_chain
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 300, (1, 4 + i), generator=generator) for i in range(8)]
    expected = [reference_generate(reference, ids, max_new_tokens=NEW_TOKENS) for ids in prompts]
    with connect(path, swarm) as model:
        solo = [model.generate(ids, max_new_tokens=NEW_TOKENS) for ids in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:  # 8 sessions at once: the servers batch them
            batched = list(pool.map(lambda ids: model.generate(ids, max_new_tokens=NEW_TOKENS), prompts))
        for index, (want, alone, together) in enumerate(zip(expected, solo, batched, strict=True)):
            assert torch.equal(alone, want), f"prompt {index}: solo differs from transformers"
            assert torch.equal(together, alone), f"prompt {index}: batched differs from solo"

        input_ids = torch.randint(3, 300, (2, 9), generator=generator)
        with torch.no_grad():
            hidden_states = reference(input_ids, output_hidden_states=True).hidden_states
        with model.inference_session(max_length=16) as session:
            session.step(model.head.embed(input_ids))
            assert len(session.route) == 2
            assert_boundaries_match(model, session, hidden_states, num_blocks=6)
        with torch.no_grad():
            expected_logits = reference(input_ids).logits
        torch.testing.assert_close(model(input_ids).logits, expected_logits, atol=1e-4, rtol=1e-4)


def test_gradients_through_the_servers_match_local_autograd(family_chain):
    path, swarm, reference = family_chain
    input_ids = torch.randint(3, 300, (2, 7), generator=torch.Generator().manual_seed(8))
    with connect(path, swarm) as model:
        model.head.requires_grad_(True)
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        reference.zero_grad()
        expected = reference(input_ids, labels=input_ids).loss
        expected.backward()
        torch.testing.assert_close(loss, expected, atol=1e-4, rtol=0)
        embeddings = reference.get_input_embeddings().weight.grad
        torch.testing.assert_close(model.head.embed_tokens.weight.grad, embeddings, atol=1e-4, rtol=1e-3)
        assert model.head.embed_tokens.weight.grad.abs().sum() > 0
        reference.zero_grad(set_to_none=True)
