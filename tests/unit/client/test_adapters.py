"""LoRA adapters made with `peft`, served by corolla's own servers in this process (tests/loopback.py) and
chosen per request: tokens, logits, the loss and its gradients are the local peft model's; sessions with
and without the adapter share servers at once; unknown adapters are refused clearly."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from corolla.client.rpc.peers import Peers
from corolla.errors import MissingBlocks, ServerUnavailable
from loopback import LoopbackSwarm
from swarm_helpers import reference_generate
from tiny_models import load_reference

PROMPT = torch.tensor([[5, 17, 42, 9, 100, 7]])


@pytest.fixture(scope="module")
def adapter(llama, tmp_path_factory):
    """A LoRA adapter with random (non-zero) weights on attention and MLP layers, saved by peft."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(load_reference(llama), config)
    folder = tmp_path_factory.mktemp("adapters") / "tiny-lora"
    peft_model.save_pretrained(folder)
    return folder, peft_model.eval()


@pytest.fixture(scope="module")
def lora_swarm(llama, adapter):
    """Blocks 0:3 and 3:6 with the adapter; a third server (0:6) without it."""
    folder, _ = adapter
    with LoopbackSwarm(llama, []) as swarm:
        for blocks in [(0, 3), (3, 6)]:
            swarm.add_server(blocks, adapters=(f"mylora={folder}",))
        swarm.add_server((0, 6))
        yield swarm


def test_adapter_outputs_equal_the_local_peft_model(reference, adapter, lora_swarm):
    _, peft_model = adapter
    expected = reference_generate(peft_model, PROMPT, max_new_tokens=16)
    assert not torch.equal(expected, reference_generate(reference, PROMPT, max_new_tokens=16))  # it matters
    assert [s.status.snapshot().adapters for s in lora_swarm.servers] == [("mylora",), ("mylora",), ()]
    model = lora_swarm.model(active_adapter="mylora")
    assert torch.equal(model.generate(PROMPT, max_new_tokens=16), expected)
    with torch.no_grad():
        torch.testing.assert_close(model(PROMPT).logits, peft_model(PROMPT).logits, atol=1e-4, rtol=0)
    with model.inference_session(max_length=8) as session:
        session.step(model.head.embed(PROMPT))
        assert {hop.peer_id for hop in session.route} <= {s.peer_id for s in lora_swarm.servers[:2]}


async def generate_twice(model, started: asyncio.Barrier, held: list[int], servers) -> list[torch.Tensor]:
    """Two greedy generations in turn; once every caller's first one has its first token, the number of
    sessions each of `servers` holds lands in `held`."""
    outputs = []
    for turn in range(2):
        new = []
        async for tokens in model.agenerate(PROMPT, max_new_tokens=24):
            new.append(tokens[:, None])
            if turn == 0 and len(new) == 1 and await asyncio.wait_for(started.wait(), 60) == 0:
                held.extend(server.status.snapshot().num_sessions for server in servers)
        outputs.append(torch.cat([PROMPT, *new], dim=1))
    return outputs


def test_sessions_with_and_without_the_adapter_share_servers(reference, adapter, lora_swarm):
    _, peft_model = adapter
    expected = {
        "mylora": reference_generate(peft_model, PROMPT, max_new_tokens=24),
        None: reference_generate(reference, PROMPT, max_new_tokens=24),
    }
    servers = lora_swarm.servers[:2]  # both clients on the adapter servers, so their steps batch together
    allowed = tuple(s.peer_id for s in servers)
    models = {name: lora_swarm.model(allowed_servers=allowed, active_adapter=name) for name in expected}
    held: list[int] = []

    async def both() -> list[list[torch.Tensor]]:
        started = asyncio.Barrier(len(models))
        return await asyncio.gather(*(generate_twice(m, started, held, servers) for m in models.values()))

    results = dict(zip(models, lora_swarm.runtime.run(both()), strict=True))
    assert held == [2, 2]  # each server held both sessions at once
    for name, outputs in expected.items():
        assert all(torch.equal(out, outputs) for out in results[name]), name


def test_lora_gradients_equal_peft(adapter, lora_swarm):
    _, peft_model = adapter
    labels = PROMPT.clone()
    model = lora_swarm.model(active_adapter="mylora")
    model.head.requires_grad_(True)
    loss = model(PROMPT, labels=labels).loss
    loss.backward()
    peft_model.zero_grad()
    for param in peft_model.parameters():
        param.requires_grad_(True)
    expected = peft_model(PROMPT, labels=labels).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    reference_norm = peft_model.base_model.model.model.norm.weight.grad
    assert model.head.norm.weight.grad.abs().sum() > 0
    torch.testing.assert_close(model.head.norm.weight.grad, reference_norm, atol=1e-4, rtol=1e-4)
    peft_model.zero_grad(set_to_none=True)


def test_unknown_adapters_are_refused_clearly(lora_swarm):
    model = lora_swarm.model(active_adapter="nope", routing_timeout=0.5)
    with pytest.raises(MissingBlocks, match="adapter 'nope'"):
        model.generate(PROMPT, max_new_tokens=2)
    model = lora_swarm.model()
    route = model.runtime.run(model.client.swarm.router.route())
    hidden = model.head.embed(PROMPT)
    # the client's routing never sends an adapter to a server that does not announce it: a refusal is the
    # server's fault (a failed server, retried elsewhere), not the caller's
    other = replace(model.client.config, active_adapter="nope")
    peers = Peers(model.client.swarm.peers.transport, model.client.dht_prefix, other)
    with pytest.raises(ServerUnavailable, match="active_adapter 'nope' is not served here"):
        model.runtime.run(peers.forward(route[0], hidden))
