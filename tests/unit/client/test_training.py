"""Servers that die during training, among corolla's own servers in this process (tests/loopback.py): a
server killed between a forward and its backward, or with a forward or backward request in hand, or just
before a forward reaches it, is banned and replaced, and the loss's gradients are those of a pass without
failures."""

from __future__ import annotations

import asyncio

import pytest
import torch

from autograd_reference import PREFIX
from corolla.client.training.lm_outputs import causal_lm_output, chain_inputs
from corolla.client.training.remote_chain import RemoteChain
from corolla.wire.messages import RPC_BACKWARD, RPC_FORWARD
from loopback import LoopbackServer, LoopbackSwarm

INPUT_IDS = torch.randint(3, 300, (4, 9), generator=torch.Generator().manual_seed(7))


@pytest.fixture
def replicated(llama):
    """Two replicas of each half of the model."""
    with LoopbackSwarm(llama, [(0, 3), (3, 6), (0, 3), (3, 6)]) as swarm:
        yield swarm


def tuned(swarm: LoopbackSwarm):
    """A model tuned with deep prompts, and the gradients of its loss on INPUT_IDS without failures (its
    parameters' gradients then cleared)."""
    model = swarm.model(tuning_mode="deep_ptune", pre_seq_len=PREFIX)
    with torch.no_grad():
        model.ptune.deep_prompts.normal_(std=0.05, generator=torch.Generator().manual_seed(0))
    model(INPUT_IDS, labels=INPUT_IDS).loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    clear_grads(model)
    return model, expected


def clear_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


def kill(swarm: LoopbackSwarm, peer_id: str) -> None:
    """Kill a server (its streams end, calls to it fail), on the swarm's loop."""

    async def die() -> None:
        swarm.network.servers[peer_id].kill()

    swarm.runtime.run(die())


def assert_grads_equal(model, expected: list[torch.Tensor]) -> None:
    for got, want in zip([p.grad for p in model.parameters()], expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("victim", ["first", "last"])
def test_a_server_killed_during_a_training_step_changes_nothing(replicated, victim):
    model, expected = tuned(replicated)

    # forward, then kill a server of the chain it used, then backward: the backward fails over
    hidden, prompts = chain_inputs(model.head, model.ptune, INPUT_IDS)
    outputs = RemoteChain.apply(hidden, prompts, model.client.passes, model.runtime)
    trace_hops = [hop.peer_id for hop, _ in outputs.grad_fn.trace]
    assert len(trace_hops) == 2
    dead = trace_hops[0 if victim == "first" else -1]
    kill(replicated, dead)
    causal_lm_output(model.head, model.ptune, outputs, INPUT_IDS).loss.backward()
    assert_grads_equal(model, expected)
    assert dead in model.client.swarm.bans.banned()

    # a forward over a chain whose server has just died (the DHT still lists it) fails over too: the
    # first route is pinned to a chain through the dead server, every later routing decision is real
    clear_grads(model)
    route = model.runtime.run(model.client.swarm.router.route())
    hop = route[-1] if victim == "first" else route[0]  # the span that still has two servers
    kill(replicated, hop.peer_id)
    real_route, pinned = model.client.swarm.router.route, [route]

    async def route_once(*args, **kwargs):
        return pinned.pop() if pinned else await real_route(*args, **kwargs)

    model.client.swarm.router.route = route_once
    model(INPUT_IDS, labels=INPUT_IDS).loss.backward()
    assert not pinned  # the pinned route was taken
    assert_grads_equal(model, expected)
    assert hop.peer_id in model.client.swarm.bans.banned()


def taking(server: LoopbackServer, rpc: str, dies: bool = False) -> list[int]:
    """Count the requests of `rpc` that `server` takes (its handler started on them), in the list
    returned; with `dies`, the server dies with the first one in hand."""
    handler = server.handlers[rpc]
    taken = []

    async def counted(request, context):
        taken.append(1)
        if dies:
            asyncio.get_running_loop().call_soon(server.kill)
        return await handler(request, context)

    server.handlers[rpc] = counted
    return taken


@pytest.mark.parametrize("rpc", [RPC_FORWARD, RPC_BACKWARD], ids=["forward", "backward"])
@pytest.mark.parametrize("hop", [0, 1], ids=["first", "last"])
def test_a_server_dying_with_a_pass_in_hand_is_replaced_and_the_gradients_stay(replicated, rpc, hop):
    model, expected = tuned(replicated)
    victim, replica = replicated.servers[hop], replicated.servers[hop + 2]  # the same blocks
    estimates = model.client.swarm.estimates
    estimates.observe_step(victim.peer_id, 0.01, 3)  # as if timed: the victim is fast, the client uses it
    estimates.observe_step(replica.peer_id, 1.0, 3)
    assert model.runtime.run(model.client.swarm.router.route())[hop].peer_id == victim.peer_id
    taken = taking(victim, rpc, dies=True)
    redone = taking(replica, rpc)
    model(INPUT_IDS, labels=INPUT_IDS).loss.backward()
    assert taken == [1] and not victim.alive
    assert redone == [1]  # the request it died with was never answered: the replica ran it again
    assert victim.peer_id in model.client.swarm.bans.banned()
    assert_grads_equal(model, expected)
