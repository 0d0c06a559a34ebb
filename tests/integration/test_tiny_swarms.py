"""Every family, through chains of 1, 2 and 3 real servers, gives exactly what transformers gives."""

from __future__ import annotations

import pytest
import torch

from swarm_helpers import TINY_CHAINS, assert_boundaries_match, connect, reference_generate


@pytest.mark.parametrize("num_servers", [1, 2, 3])
def test_greedy_generation_and_boundaries_match_transformers(family_swarm, num_servers):
    path, swarm, reference = family_swarm
    input_ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(num_servers))
    expected = reference_generate(reference, input_ids, max_new_tokens=24)
    with connect(path, swarm, TINY_CHAINS[num_servers]) as model:
        assert torch.equal(model.generate(input_ids, max_new_tokens=24), expected)

        with torch.no_grad():
            hidden_states = reference(input_ids, output_hidden_states=True).hidden_states
        with model.inference_session(max_length=16) as session:
            session.step(model.head.embed(input_ids))
            assert len(session.route) == num_servers
            assert_boundaries_match(model, session, hidden_states, num_blocks=6)

        logits = model(input_ids).logits  # rpc_forward path
        torch.testing.assert_close(logits, reference(input_ids).logits, atol=1e-4, rtol=0)
