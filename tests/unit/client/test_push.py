"""Server-to-server push among corolla's own servers in this process (tests/loopback.py): most decode steps
reach the later servers by push, each step runs once per server, the tokens are those without push; a step
abandoned after its first hop still travels the chain by push, and the next step at its position rolls
every server back and skips the late replies to it. A previous hop that forges its pushes (other hidden
states, or another kept path of a token tree) never gets its outputs taken for the client's step, and
never gets the honest next server banned."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from corolla.client.chain.push_trust import PushTrust
from corolla.client.chain.session import InferenceSession
from corolla.client.rpc.span_stream import Step, StepRoute
from corolla.models.head import ModelHead
from corolla.wire import tensors as wire_tensors
from corolla.wire.messages import RPC_INFERENCE, RPC_PUSH, InferenceStep, NextServer, StepReply
from loopback import LoopbackSwarm, generate_together

NEW_TOKENS = 32
SPANS = [(0, 2), (2, 4), (4, 6)]


def step_counts(servers) -> list[tuple[int, int]]:
    """Each server's steps computed from the client's copy and from a pushed copy, so far."""
    return [(s.status.snapshot().steps_from_client, s.status.snapshot().steps_from_push) for s in servers]


def generate_counting(model, servers, prompt: torch.Tensor) -> tuple[torch.Tensor, list, list]:
    """The tokens, and each server's steps from the client and by push during the generation."""
    before = step_counts(servers)
    tokens = model.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    after = step_counts(servers)
    client = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    pushed = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    return tokens, client, pushed


def test_most_steps_arrive_by_push_and_results_do_not_change(llama):
    prompt = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(3))
    with LoopbackSwarm(llama, SPANS) as swarm:
        without_push, client, pushed = generate_counting(swarm.model(use_push=False), swarm.servers, prompt)
        assert pushed == [0, 0, 0] and client == [NEW_TOKENS] * 3  # no push at all
        with_push, client, pushed = generate_counting(swarm.model(), swarm.servers, prompt)
    assert torch.equal(with_push, without_push)
    # the prompt step and the 31 decode steps that follow it
    assert pushed[0] == 0 and client[0] == NEW_TOKENS  # the first server hears from the client only
    for server in (1, 2):  # every step ran once; most of them by push
        assert client[server] + pushed[server] == NEW_TOKENS
        assert pushed[server] > NEW_TOKENS // 2, f"server {server}: {pushed[server]} steps by push"


def test_concurrent_sessions_are_announced_down_the_chain_and_stay_exact(llama):
    """Each server announces the steps it starts computing to the next one (engine/batching.py): the later
    servers take announcements, the first hears from the client only, and the tokens do not change."""
    prompts = [
        torch.randint(3, 300, (1, 6 + i), generator=torch.Generator().manual_seed(i)) for i in range(4)
    ]
    with LoopbackSwarm(llama, SPANS) as swarm:
        model = swarm.model()
        alone = [model.generate(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
        before = [s.status.snapshot().steps_announced for s in swarm.servers]
        together, held = model.runtime.run(generate_together(model, swarm.servers, prompts, 12))
        taken = [s.status.snapshot().steps_announced - b for s, b in zip(swarm.servers, before, strict=True)]
    assert held == [4, 4, 4]  # the sessions really overlapped
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))
    assert taken[0] == 0 and taken[1] > 4 and taken[2] > 4, taken


def step_ids(network, rpc: str, direction: str, peer_id: str) -> list[str | None]:
    """The step id of every message of the wire log on `rpc` to or from `peer_id` (its metadata), but for
    pushes without tensors (announcements of steps on their way, engine/batching.py)."""
    ids = []
    for logged_rpc, logged_direction, server, message in network.wire:
        if rpc == RPC_PUSH and not message.tensors:
            continue
        if (logged_rpc, logged_direction, server) == (rpc, direction, peer_id):
            if direction == "reply":
                ids.append(StepReply.from_bytes(message.metadata).step_id)
            else:
                ids.append(InferenceStep.from_bytes(message.metadata, first=False).step_id)
    return ids


async def test_a_step_abandoned_midway_is_rolled_back_and_its_late_replies_are_skipped(
    network, llama, reference
):
    """A step given up after its first server (as when a caller gives up) still reaches the next servers
    by push, and they reply to it. The next step at the same position must roll every server back, and
    the client must not take those late replies for the next step's."""
    head = ModelHead.load(llama, torch.float32)
    servers = [await network.add_server(span) for span in SPANS]
    client = network.client()
    ids = torch.randint(3, 300, (1, 6), generator=torch.Generator().manual_seed(4))
    async with InferenceSession(client.swarm, None, 16) as session:
        await session.astep(head.embed(ids[:, :5]))
        assert [hop.peer_id for hop in session.route] == [s.peer_id for s in servers]
        first, *later = session.chain.links
        before = step_counts(servers)
        network.recording = True
        next_servers = tuple(
            NextServer(link.hop.peer_id, link.stream.session_id, link.hop.start, link.hop.end)
            for link in later
        )
        abandoned = StepRoute("abandoned", next_servers)
        await first.stream.step(Step(head.embed(torch.tensor([[7]])), 5), abandoned)  # the first hop only

        def pushed_to_both() -> bool:
            after = step_counts(servers)
            return all(after[i][1] - before[i][1] == 1 for i in (1, 2))

        for _ in range(1000):  # 10 s at most
            if pushed_to_both():
                break
            await asyncio.sleep(0.01)
        assert pushed_to_both()  # the second and third servers ran the abandoned step
        for server in servers[1:]:  # ... pushed, never sent by the client, and replied to it
            assert step_ids(network, RPC_PUSH, "request", server.peer_id) == ["abandoned"]
            assert step_ids(network, RPC_INFERENCE, "request", server.peer_id) == []
            await _replied(network, server.peer_id, "abandoned")
        last = await session.astep(head.embed(ids[:, 5:6]))
        assert session.num_failovers == 0 and session.position == 6
    logits = head.logits(last)
    with torch.no_grad():
        expected = reference(ids).logits[:, 5:6]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


async def _replied(network, peer_id: str, step_id: str) -> None:
    for _ in range(1000):  # 10 s at most: the reply leaves once the step ran
        if step_id in step_ids(network, RPC_INFERENCE, "reply", peer_id):
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"{peer_id} never replied to step {step_id}")


class ForgingPusher:
    """The previous hop as an attacker: it pushes other hidden states under each step's id, then holds
    its reply to the client back, so that its forged copy runs at the next server before the client's."""

    def __init__(self, honest):
        self.honest = honest
        self.forged = 0

    async def push(self, outputs, meta, position, origin, from_session):
        forged = wire_tensors.deserialize(outputs, "outputs") + 1.0
        await self.honest.push(wire_tensors.serialize(forged), meta, position, origin, from_session)
        self.forged += 1
        await asyncio.sleep(0.3)  # the client's own copy reaches the next server 0.3 s after the forgery

    def announce(self, meta, position, origin, from_session, due_in):
        self.honest.announce(meta, position, origin, from_session, due_in)

    def end_session(self, origin, session_id):
        self.honest.end_session(origin, session_id)


async def test_a_forged_push_that_runs_first_is_never_taken_for_the_clients_step(network, llama, reference):
    """The next server runs the forged copy first and replies to it, then runs the client's copy. Each
    reply names the inputs it ran (a digest and the position): the client skips the forged one and takes
    the reply to what it sent, and stops letting the forger push into that server."""
    head = ModelHead.load(llama, torch.float32)
    servers = [await network.add_server(span) for span in SPANS]
    forger = ForgingPusher(servers[0].pusher)
    servers[0].inference.pusher = forger
    client = network.client()
    ids = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(5))
    logits = []
    async with InferenceSession(client.swarm, None, 16) as session:
        logits.append(head.logits(await session.astep(head.embed(ids[:, :5]))))
        for position in range(5, 9):
            logits.append(head.logits(await session.astep(head.embed(ids[:, position : position + 1]))))
        assert session.num_failovers == 0
    with torch.no_grad():
        expected = reference(ids).logits
    torch.testing.assert_close(torch.cat(logits, dim=1), expected, atol=1e-4, rtol=0)
    ran_forged = step_counts(servers)[1][1]
    assert forger.forged >= 1 and ran_forged >= 1  # the forged copy really ran first at the next server
    assert forger.forged <= 2  # after its first forgery, the client no longer names it as a pusher


PARENTS = (-1, 0, 0, 1, 2)  # a token tree: paths 0-1-3 and 0-2-4
KEPT, FORGED_PATH = (0, 2), (0, 1)


class PathForgingPusher(ForgingPusher):
    """The previous hop as an attacker after a speculative tree step: it pushes its true outputs, but
    names another path of the tree as the one the step keeps; the next server takes it and drops the
    tree's other branches, so it must refuse the client's own copy (which keeps the true path)."""

    async def push(self, outputs, meta, position, origin, from_session):
        if meta.accepted == KEPT:
            meta = dataclasses.replace(meta, accepted=FORGED_PATH)
            self.forged += 1
        await self.honest.push(outputs, meta, position, origin, from_session)
        await asyncio.sleep(0.3)


async def test_a_server_that_a_forged_path_made_refuse_the_clients_step_is_not_banned(
    network, llama, reference
):
    head = ModelHead.load(llama, torch.float32)
    servers = [await network.add_server(span) for span in SPANS]
    forger = PathForgingPusher(servers[0].pusher)
    servers[0].inference.pusher = forger
    client = network.client()
    ids = torch.randint(3, 300, (1, 10), generator=torch.Generator().manual_seed(6))
    prompt, nodes, later = ids[:, :4], ids[:, 4:9], ids[:, 9:]
    async with InferenceSession(client.swarm, None, 16) as session:
        await session.astep(head.embed(prompt))
        await session.astep(head.embed(nodes), tree=PARENTS)
        session.accept(KEPT)
        logits = head.logits(await session.astep(head.embed(later)))
    assert forger.forged == 1 and step_counts(servers)[1][1] >= 1  # the forged path ran at server 1
    assert client.swarm.bans.banned() == set()  # no honest server is avoided for the forger's lie
    with torch.no_grad():
        expected = reference(torch.cat([prompt, nodes[:, list(KEPT)], later], dim=1)).logits[:, -1:]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_a_forger_loses_its_right_to_push_there_and_a_refusing_server_is_excused_once():
    trust = PushTrust()
    assert trust.allows("forger", "next")
    trust.distrust("forger", "next")
    trust.distrust(None, "other")  # a hop that takes no pushes: no one to blame
    assert not trust.allows("forger", "next")
    assert trust.allows("forger", "other") and trust.allows("honest", "next")
    assert trust.excuse("next") and not trust.excuse("next")  # claiming it again is a failure like any
