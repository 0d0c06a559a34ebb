"""A long prompt through a chain as a pipeline of chunks (client/chain/pipeline.py), over corolla's own
servers in this process (tests/loopback.py): every hop gets it in chunks, in order, the tokens are
transformers' own, and a server that dies in the middle of the pipeline is replaced like any failed one."""

from __future__ import annotations

import pytest
import torch

from corolla.client.chain.pipeline import PIPELINE_CHUNK
from loopback import LoopbackSwarm
from swarm_helpers import reference_generate

CHAIN = [(0, 2), (2, 4), (4, 6)]
NEW_TOKENS = 6
PROMPT = torch.randint(3, 300, (1, 2 * PIPELINE_CHUNK + 40), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def expected(reference):
    return reference_generate(reference, PROMPT, max_new_tokens=NEW_TOKENS)


def test_a_long_prompt_runs_through_the_hops_in_chunks(llama, expected):
    with LoopbackSwarm(llama, CHAIN) as swarm:
        model = swarm.model(prefix_cache=0)
        assert torch.equal(model.generate(PROMPT, max_new_tokens=NEW_TOKENS), expected)
        # 3 chunks of the prompt, then a decode step per new token but the last
        assert [server.steps_received for server in swarm.servers] == [3 + NEW_TOKENS - 1] * 3


@pytest.mark.parametrize("hop", [0, 1, 2])
def test_a_server_that_dies_mid_pipeline_is_replaced(llama, expected, hop):
    with LoopbackSwarm(llama, CHAIN) as swarm:
        model = swarm.model(prefix_cache=0)
        swarm.add_server(CHAIN[hop])
        with model.inference_session(PROMPT.shape[1] + NEW_TOKENS) as session:
            victim = swarm.network.servers[session.route[hop].peer_id]
            victim.dies_at_step = 2  # with its second chunk in hand
            tokens = model.generate(PROMPT, session=session, max_new_tokens=NEW_TOKENS)
            assert not victim.alive and session.num_failovers == 1
        assert torch.equal(tokens, expected)
