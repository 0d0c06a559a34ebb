"""Fine-tuning through corolla's own servers in this process (tests/loopback.py): for each llama-like
family, the loss and gradients of a model tuned with deep prompts through chains of 1, 2 and 3 servers,
and the gradient wrt a chain's own inputs, are local autograd's; generation uses the trained prompts;
batches too big for one message go over the stream RPCs and stay exact."""

from __future__ import annotations

import pytest
import torch

from autograd_reference import PREFIX, check_gradients, run_blocks
from corolla.client.training.remote_chain import RemoteChain
from corolla.wire.messages import RPC_BACKWARD_STREAM
from loopback import LoopbackSwarm
from swarm_helpers import TINY_CHAINS, TINY_SPANS
from tiny_models import LLAMA_LIKE, load_reference


@pytest.fixture(scope="module", params=LLAMA_LIKE)
def family_swarm(request, tiny_models):
    """Servers of one tiny family over TINY_SPANS (chains of 1, 2 and 3 servers), and transformers'
    model of it."""
    path = tiny_models[request.param]
    with LoopbackSwarm(path, TINY_SPANS) as swarm:
        yield swarm, load_reference(path)


@pytest.mark.parametrize("num_servers", [1, 2, 3])
def test_gradients_match_local_autograd(family_swarm, num_servers):
    swarm, reference = family_swarm
    generator = torch.Generator().manual_seed(num_servers)
    input_ids = torch.randint(3, 300, (2, 7), generator=generator)
    labels = input_ids.clone()
    labels[1, -2:] = -100  # padding
    chain = {swarm.servers[i].peer_id for i in TINY_CHAINS[num_servers]}
    model = swarm.model(allowed_servers=tuple(chain), tuning_mode="deep_ptune", pre_seq_len=PREFIX)
    check_gradients(model, reference, input_ids, labels)

    # the gradient wrt the chain's own inputs, for an arbitrary output gradient
    hidden = torch.randn(3, 5, 64, generator=generator, requires_grad=True)
    grad_outputs = torch.randn(3, 5, 64, generator=generator)
    outputs = RemoteChain.apply(hidden, torch.empty(0), model.client.passes, model.runtime)
    assert {hop.peer_id for hop, _ in outputs.grad_fn.trace} == chain  # through exactly those servers
    outputs.backward(grad_outputs)
    local = hidden.detach().clone().requires_grad_()
    run_blocks(reference, local).backward(grad_outputs)
    torch.testing.assert_close(hidden.grad, local.grad, atol=1e-4, rtol=1e-4)


@pytest.fixture
def llama_swarm(llama, reference):
    with LoopbackSwarm(llama, TINY_SPANS) as swarm:
        yield swarm, reference


def test_generation_uses_the_trained_prompts(llama_swarm):
    swarm, _ = llama_swarm
    input_ids = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(3))
    model = swarm.model(tuning_mode="deep_ptune", pre_seq_len=PREFIX)
    with torch.no_grad():
        model.ptune.deep_prompts.normal_(std=0.3, generator=torch.Generator().manual_seed(0))
        expected = input_ids
        for _ in range(8):  # greedy decoding by full forward passes, which use the prompts
            expected = torch.cat([expected, model(expected).logits[:, -1:].argmax(dim=-1)], dim=1)
    assert torch.equal(model.generate(input_ids, max_new_tokens=8, ignore_eos=True), expected)
    with torch.no_grad():
        model.ptune.deep_prompts.zero_()
        model.ptune.prompt_embeddings.normal_(std=1.0, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(model.generate(input_ids, max_new_tokens=8, ignore_eos=True), expected)


def test_big_batches_go_over_the_stream_rpcs(llama_swarm):
    """64 x 100 tokens: inputs + output gradients are 3.3 MB, over the unary limit (rpc_backward_stream)."""
    swarm, reference = llama_swarm
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(64, 100, 64, generator=generator, requires_grad=True)
    grad_outputs = torch.randn(64, 100, 64, generator=generator)
    model = swarm.model(max_request_tokens=6400)
    swarm.network.recording = True
    outputs = RemoteChain.apply(hidden, torch.empty(0), model.client.passes, model.runtime)
    outputs.backward(grad_outputs)
    swarm.network.recording = False
    hops = [hop.peer_id for hop, _ in outputs.grad_fn.trace]
    streamed = {server for rpc, _, server, _ in swarm.network.wire if rpc == RPC_BACKWARD_STREAM}
    assert streamed == set(hops)  # every hop's backward went over a stream
    local = hidden.detach().clone().requires_grad_()
    expected = run_blocks(reference, local)
    expected.backward(grad_outputs)
    torch.testing.assert_close(outputs, expected, atol=1e-4, rtol=1e-4)
    # 64 x 100 positions of random output gradients make big input gradients: compare relative to their scale
    error = (hidden.grad - local.grad).abs().max() / local.grad.abs().max()
    assert error < 1e-4, f"relative error {error:.2e}, gradient scale {local.grad.abs().max():.1f}"
