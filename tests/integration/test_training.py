"""Fine-tuning through the swarm: gradients through 1, 2 and 3 real servers equal local autograd.

The reference is transformers' own model with the same trainable parts: the input prefix goes through
`inputs_embeds`, and each deep prompt is added to its decoder layer's input by a forward pre-hook.
"""

from __future__ import annotations

import pytest
import torch

from corolla.client.training import RemoteChain
from corolla.launch.local import LocalSwarm
from swarm_helpers import SMOL_CHAINS, TINY_CHAINS, connect

PREFIX = 3


def reference_loss(reference, input_ids, labels, prefix, deep_prompts):
    """transformers' loss with a trainable input prefix [P, H] and deep prompts [blocks, P, H]."""
    hooks = []
    for index, layer in enumerate(reference.model.layers):

        def add_prompt(module, args, kwargs, index=index):
            hidden = args[0] if args else kwargs["hidden_states"]
            hidden = torch.cat([hidden[:, :PREFIX] + deep_prompts[index], hidden[:, PREFIX:]], dim=1)
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        hooks.append(layer.register_forward_pre_hook(add_prompt, with_kwargs=True))
    try:
        embeds = reference.model.embed_tokens(input_ids)
        inputs = torch.cat([prefix[None].expand(len(input_ids), -1, -1), embeds], dim=1)
        logits = reference(inputs_embeds=inputs).logits[:, PREFIX:]
    finally:
        for hook in hooks:
            hook.remove()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
    )


def check_gradients(model, reference, input_ids, labels, atol=1e-4):
    torch.manual_seed(0)
    with torch.no_grad():
        model.ptune.deep_prompts.normal_(std=0.05)  # not zero, so that every path carries gradient
    model.head.requires_grad_(True)
    loss = model(input_ids, labels=labels).loss
    loss.backward()

    reference.zero_grad()
    prefix = model.ptune.prompt_embeddings.detach().clone().requires_grad_()
    deep = model.ptune.deep_prompts.detach().clone().requires_grad_()
    expected = reference_loss(reference, input_ids, labels, prefix, deep)
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=atol, rtol=0)
    torch.testing.assert_close(model.ptune.prompt_embeddings.grad, prefix.grad, atol=atol, rtol=atol)
    torch.testing.assert_close(model.ptune.deep_prompts.grad, deep.grad, atol=atol, rtol=atol)
    torch.testing.assert_close(
        model.head.norm.weight.grad, reference.model.norm.weight.grad, atol=atol, rtol=atol
    )
    torch.testing.assert_close(
        model.head.embed_tokens.weight.grad, reference.model.embed_tokens.weight.grad, atol=atol, rtol=atol
    )
    assert deep.grad.abs().sum() > 0 and prefix.grad.abs().sum() > 0
    reference.zero_grad(set_to_none=True)


def run_blocks(reference, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' decoder layers alone over hidden [B, T, H] (causal, positions from 0)."""
    length = hidden.shape[1]
    position_ids = torch.arange(length)[None]
    rotary = reference.model.rotary_emb(hidden, position_ids)
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    for layer in reference.model.layers:
        hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary)
    return hidden


@pytest.mark.parametrize("num_servers", [1, 2, 3])
def test_gradients_match_local_autograd(family_swarm, num_servers):
    path, swarm, reference = family_swarm
    generator = torch.Generator().manual_seed(num_servers)
    input_ids = torch.randint(3, 300, (2, 7), generator=generator)
    labels = input_ids.clone()
    labels[1, -2:] = -100  # padding
    with connect(
        path, swarm, TINY_CHAINS[num_servers], tuning_mode="deep_ptune", pre_seq_len=PREFIX
    ) as model:
        check_gradients(model, reference, input_ids, labels)

        # the gradient wrt the chain's own inputs, for an arbitrary output gradient
        hidden = torch.randn(3, 5, 64, generator=generator, requires_grad=True)
        grad_outputs = torch.randn(3, 5, 64, generator=generator)
        RemoteChain.apply(hidden, torch.empty(0), model.swarm, model.runtime).backward(grad_outputs)
        local = hidden.detach().clone().requires_grad_()
        run_blocks(reference, local).backward(grad_outputs)
        torch.testing.assert_close(hidden.grad, local.grad, atol=1e-4, rtol=1e-4)


def test_smollm2_gradients_match_local_autograd(smollm2_path, smol_swarm, smol_reference):
    tokenizer_ids = torch.tensor(
        [[1, 504, 3458, 282, 4649, 314, 7042, 30], [1, 2683, 314, 260, 1326, 2, 2, 2]]
    )
    labels = tokenizer_ids.clone()
    labels[1, -3:] = -100
    with connect(
        smollm2_path, smol_swarm, SMOL_CHAINS[3], tuning_mode="deep_ptune", pre_seq_len=PREFIX
    ) as model:
        check_gradients(model, smol_reference, tokenizer_ids, labels)


@pytest.fixture
def replicated_tiny(tiny_models):
    with LocalSwarm(str(tiny_models["llama"]), [(0, 3), (3, 6), (0, 3), (3, 6)]) as swarm:
        yield swarm


def kill(swarm: LocalSwarm, peer_id: str) -> None:
    """SIGKILL a server (and its DHT process and daemon)."""
    server = next(s for s in swarm.servers if s.peer_id == peer_id)
    server.kill_group()
    swarm.servers.remove(server)


def assert_grads_equal(model, expected: list[torch.Tensor]) -> None:
    for got, want in zip([p.grad for p in model.parameters()], expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("victim", ["first", "last"])
def test_a_server_killed_during_a_training_step_changes_nothing(tiny_models, replicated_tiny, victim):
    input_ids = torch.randint(3, 300, (4, 9), generator=torch.Generator().manual_seed(7))
    with connect(
        tiny_models["llama"], replicated_tiny, tuning_mode="deep_ptune", pre_seq_len=PREFIX
    ) as model:
        with torch.no_grad():
            model.ptune.deep_prompts.normal_(std=0.05)
        model(input_ids, labels=input_ids).loss.backward()
        expected = [p.grad.clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = None

        # forward, then SIGKILL a server of the chain it used, then backward: the backward fails over
        hidden, prompts = model._chain_inputs(input_ids)
        outputs = RemoteChain.apply(hidden, prompts, model.client.passes, model.runtime)
        trace_hops = [hop.peer_id for hop, _ in outputs.grad_fn.trace]
        dead = trace_hops[0 if victim == "first" else -1]
        kill(replicated_tiny, dead)
        model._outputs(outputs, input_ids).loss.backward()
        assert_grads_equal(model, expected)
        assert dead in model.client.swarm.bans.banned()

        # a forward over a chain whose server has just died (the DHT still lists it) fails over too: the
        # first route is pinned to a chain through the dead server, every later routing decision is real
        for p in model.parameters():
            p.grad = None
        route = model.runtime.run(model.client.swarm.router.route())
        hop = route[-1] if victim == "first" else route[0]  # the span that still has two servers
        kill(replicated_tiny, hop.peer_id)
        real_route, pinned = model.client.swarm.router.route, [route]

        async def route_once(*args, **kwargs):
            return pinned.pop() if pinned else await real_route(*args, **kwargs)

        model.client.swarm.router.route = route_once
        model(input_ids, labels=input_ids).loss.backward()
        assert_grads_equal(model, expected)
        assert hop.peer_id in model.client.swarm.bans.banned()


@pytest.mark.parametrize("family_swarm", ["llama"], indirect=True)
def test_generation_uses_the_trained_prompts(family_swarm):
    path, swarm, _ = family_swarm
    input_ids = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(3))
    with connect(path, swarm, tuning_mode="deep_ptune", pre_seq_len=PREFIX) as model:
        with torch.no_grad():
            model.ptune.deep_prompts.normal_(std=0.3)
            expected = input_ids
            for _ in range(8):  # greedy decoding by full forward passes, which use the prompts
                expected = torch.cat([expected, model(expected).logits[:, -1:].argmax(dim=-1)], dim=1)
        assert torch.equal(model.generate(input_ids, max_new_tokens=8), expected)
        with torch.no_grad():
            model.ptune.deep_prompts.zero_()
            model.ptune.prompt_embeddings.normal_(std=1.0)
        assert not torch.equal(model.generate(input_ids, max_new_tokens=8), expected)


@pytest.mark.parametrize("family_swarm", ["llama"], indirect=True)
def test_big_batches_go_over_the_stream_rpcs(family_swarm):
    """64 x 100 tokens: inputs + output gradients are 3.3 MB, over the unary limit (rpc_backward_stream)."""
    path, swarm, reference = family_swarm
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(64, 100, 64, generator=generator, requires_grad=True)
    grad_outputs = torch.randn(64, 100, 64, generator=generator)
    with connect(path, swarm, max_request_tokens=6400) as model:
        outputs = RemoteChain.apply(hidden, torch.empty(0), model.swarm, model.runtime)
        outputs.backward(grad_outputs)
    local = hidden.detach().clone().requires_grad_()
    expected = run_blocks(reference, local)
    expected.backward(grad_outputs)
    torch.testing.assert_close(outputs, expected, atol=1e-4, rtol=1e-4)
    # 64 x 100 positions of random output gradients make big input gradients: compare relative to their scale
    error = (hidden.grad - local.grad).abs().max() / local.grad.abs().max()
    assert error < 1e-4, f"relative error {error:.2e}, gradient scale {local.grad.abs().max():.1f}"
