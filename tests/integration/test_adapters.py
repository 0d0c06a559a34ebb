"""LoRA adapters made with `peft`, served by corolla servers and chosen per request."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from corolla.client.peers import Peers
from corolla.errors import MissingBlocks, ServerUnavailable
from corolla.launch.local import LocalSwarm
from swarm_helpers import connect, reference_generate
from tiny_models import load_reference

PROMPT = torch.tensor([[5, 17, 42, 9, 100, 7]])


@pytest.fixture(scope="module")
def adapter(tiny_models, tmp_path_factory):
    """A LoRA adapter with random (non-zero) weights on attention and MLP layers, saved by peft."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(load_reference(tiny_models["llama"]), config)
    folder = tmp_path_factory.mktemp("adapters") / "tiny-lora"
    peft_model.save_pretrained(folder)
    return folder, peft_model.eval()


@pytest.fixture(scope="module")
def lora_swarm(tiny_models, adapter):
    """Blocks 0:3 and 3:6 with the adapter; a third server (0:6) without it."""
    folder, _ = adapter
    with LocalSwarm(str(tiny_models["llama"]), [], server_args=["--max-cache-tokens", "2048"]) as swarm:
        for blocks in [(0, 3), (3, 6)]:
            swarm.add_server(blocks, extra_args=["--adapters", f"mylora={folder}"])
        swarm.add_server((0, 6))
        yield swarm


def test_adapter_outputs_equal_the_local_peft_model(tiny_models, adapter, lora_swarm):
    _, peft_model = adapter
    expected = reference_generate(peft_model, PROMPT, max_new_tokens=16)
    base = reference_generate(load_reference(tiny_models["llama"]), PROMPT, max_new_tokens=16)
    assert not torch.equal(expected, base)  # the adapter changes the answer
    with connect(tiny_models["llama"], lora_swarm, active_adapter="mylora") as model:
        assert torch.equal(model.generate(PROMPT, max_new_tokens=16), expected)
        with torch.no_grad():
            torch.testing.assert_close(model(PROMPT).logits, peft_model(PROMPT).logits, atol=1e-4, rtol=0)
        with model.inference_session(max_length=8) as session:
            session.step(model.head.embed(PROMPT))
            assert {hop.peer_id for hop in session.route} <= {s.peer_id for s in lora_swarm.servers[:2]}


def test_sessions_with_and_without_the_adapter_share_servers(tiny_models, adapter, lora_swarm):
    _, peft_model = adapter
    expected = {
        "mylora": reference_generate(peft_model, PROMPT, max_new_tokens=24),
        None: reference_generate(load_reference(tiny_models["llama"]), PROMPT, max_new_tokens=24),
    }
    allowed = [0, 1]  # both clients on the adapter servers, so their steps batch together
    results = {}

    def run(name):
        with connect(tiny_models["llama"], lora_swarm, allowed, active_adapter=name) as model:
            results[name] = [model.generate(PROMPT, max_new_tokens=24) for _ in range(2)]

    threads = [threading.Thread(target=run, args=(name,)) for name in expected]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for name, outputs in expected.items():
        assert all(torch.equal(out, outputs) for out in results[name]), name


def test_lora_gradients_equal_peft(tiny_models, adapter, lora_swarm):
    _, peft_model = adapter
    labels = PROMPT.clone()
    with connect(tiny_models["llama"], lora_swarm, active_adapter="mylora") as model:
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
    torch.testing.assert_close(model.head.norm.weight.grad, reference_norm, atol=1e-4, rtol=1e-4)
    peft_model.zero_grad(set_to_none=True)


def test_unknown_adapters_are_refused_clearly(tiny_models, lora_swarm):
    with (
        connect(tiny_models["llama"], lora_swarm, active_adapter="nope", routing_timeout=1.0) as model,
        pytest.raises(MissingBlocks, match="adapter 'nope'"),
    ):
        model.generate(PROMPT, max_new_tokens=2)
    with connect(tiny_models["llama"], lora_swarm) as model:
        route = model.runtime.run(model.client.swarm.router.route())
        hidden = model.head.embed(PROMPT)
        # the client's routing never sends an adapter to a server that does not announce it: a refusal is
        # the server's fault (a failed server, retried elsewhere), not the caller's
        with pytest.raises(ServerUnavailable, match="active_adapter 'nope' is not served here"):
            other = replace(model.client.config, active_adapter="nope")
            peers = Peers(model.client.swarm.peers.transport, model.client.dht_prefix, other)
            model.runtime.run(peers.forward(route[0], hidden))
