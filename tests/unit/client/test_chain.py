"""A chain of servers, socket-free (tests/loopback.py): every boundary exact, failover at every hop and
during a replacement's replay, push routes after a replacement, rewinds, frozen servers, stale replies."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.proto import runtime_pb2

from corolla.client.chain.session import InferenceSession
from corolla.client.rpc import stall_probe
from corolla.client.rpc.span_stream import Opening, SpanStream, Step, StepRoute, StepSkipped
from corolla.errors import MissingBlocks, ServerUnavailable
from corolla.models.head import ModelHead
from corolla.swarm.policy.routing import Hop
from corolla.wire import tensors as wire_tensors
from corolla.wire.digest import step_digest
from corolla.wire.messages import StepReply
from tiny_models import hidden_states

PROMPT = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
LATER = torch.randint(3, 300, (2, 4), generator=torch.Generator().manual_seed(1))


def boundaries(session: InferenceSession, outputs: torch.Tensor, length: int) -> dict[int, torch.Tensor]:
    """The last `length` positions at every block boundary of the session's chain: each hop's inputs are
    its predecessor's outputs; the last hop's outputs are the step's."""
    found = {link.hop.start: link.history.inputs[:, -length:] for link in session.chain.links[1:]}
    return {**found, session.route[-1].end: outputs}


def assert_exact(head, reference, ids: torch.Tensor, found: dict[int, torch.Tensor]) -> None:
    expected = hidden_states(reference, ids)
    for block, outputs in found.items():
        outputs = head.norm(outputs) if block == len(expected) - 1 else outputs
        torch.testing.assert_close(outputs, expected[block][:, -outputs.shape[1] :], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def head(llama):
    return ModelHead.load(llama, torch.float32)


async def decode(session, head, ids: torch.Tensor) -> list[torch.Tensor]:
    """The prompt, then each later token one step at a time; each step's outputs."""
    outputs = [await session.astep(head.embed(ids[:, : PROMPT.shape[1]]))]
    for i in range(PROMPT.shape[1], ids.shape[1]):
        outputs.append(await session.astep(head.embed(ids[:, i : i + 1])))
    return outputs


async def test_every_boundary_of_a_three_hop_chain_is_what_transformers_computes(network, head, reference):
    servers = [await network.add_server(span) for span in [(0, 2), (2, 4), (4, 6)]]
    client = network.client()
    ids = torch.cat([PROMPT, LATER], dim=1)
    async with InferenceSession(client.swarm, None, 32, servers=[s.peer_id for s in servers]) as session:
        outputs = await decode(session, head, ids)
        assert [hop.peer_id for hop in session.route] == [s.peer_id for s in servers]
        assert_exact(head, reference, ids, boundaries(session, outputs[-1], 1))
        assert session.position == ids.shape[1] and session.num_failovers == 0
    # with push, each server after the first ran the decode steps from its predecessor's push, once
    assert all(s.status.snapshot().steps_from_push > 0 for s in servers[1:])
    assert sum(s.steps_received for s in servers) == 3 * (1 + LATER.shape[1])  # the client's copies too


async def three_hops(network) -> list:
    return [await network.add_server(span) for span in [(0, 2), (2, 4), (4, 6)]]


@pytest.mark.parametrize("victim", [0, 1, 2])
async def test_a_server_killed_with_a_step_in_hand_is_replaced_and_replayed_exactly(
    network, head, reference, victim
):
    chain = await three_hops(network)
    client = network.client()
    ids = torch.cat([PROMPT, LATER], dim=1)
    async with InferenceSession(client.swarm, None, 32) as session:
        await session.astep(head.embed(PROMPT))
        await network.add_server((0, 3))  # replicas join; blocks 2:4 need both of them
        await network.add_server((3, 6))
        chain[victim].dies_at_step = chain[victim].steps_received + 2  # the second decode step
        outputs = [await session.astep(head.embed(ids[:, i : i + 1])) for i in range(9, ids.shape[1])]
        assert session.num_failovers == 1 and not chain[victim].alive
        assert chain[victim].peer_id not in {hop.peer_id for hop in session.route}
        assert chain[victim].peer_id in client.swarm.bans.banned()
        assert_exact(head, reference, ids, boundaries(session, outputs[-1], 1))
        if victim == 1:  # its blocks now take two hops, each brought to the same state
            assert [(hop.start, hop.end) for hop in session.route] == [(0, 2), (2, 3), (3, 4), (4, 6)]


async def test_a_replacement_that_dies_while_it_replays_is_replaced_too(network, head, reference):
    chain = await three_hops(network)
    client = network.client()
    ids = torch.cat([PROMPT, LATER], dim=1)
    async with InferenceSession(client.swarm, None, 32) as session:
        await session.astep(head.embed(PROMPT))
        first, second = await network.add_server((2, 4)), await network.add_server((2, 4))
        client.swarm.estimates.observe_step(second.peer_id, 1.0, 2)  # slow: the first is chosen first
        first.dies_at_step = 1  # ... and dies replaying
        chain[1].dies_at_step = chain[1].steps_received + 1
        outputs = [await session.astep(head.embed(ids[:, i : i + 1])) for i in range(9, ids.shape[1])]
        assert session.num_failovers == 1 and not first.alive and second.alive
        assert [hop.peer_id for hop in session.route] == [chain[0].peer_id, second.peer_id, chain[2].peer_id]
        assert_exact(head, reference, ids, boundaries(session, outputs[-1], 1))


async def test_after_a_replacement_each_server_takes_pushes_from_its_new_predecessor(
    network, head, reference
):
    chain = await three_hops(network)
    client = network.client()
    ids = torch.cat([PROMPT, LATER], dim=1)
    async with InferenceSession(client.swarm, None, 32) as session:
        await session.astep(head.embed(PROMPT))
        replacement = await network.add_server((2, 4))
        chain[1].kill()
        outputs = [await session.astep(head.embed(ids[:, i : i + 1])) for i in range(9, ids.shape[1])]
        assert [hop.peer_id for hop in session.route] == [
            chain[0].peer_id,
            replacement.peer_id,
            chain[2].peer_id,
        ]
        for previous, link in zip(session.chain.links, session.chain.links[1:], strict=False):
            server = network.servers[link.hop.peer_id]
            owned = server.spans.find_session("client", link.stream.session_id)
            assert owned.push_from == previous.hop.peer_id  # the one peer it takes pushes from
        # the replacement and the last server ran decode steps from pushes after the failover
        assert replacement.status.snapshot().steps_from_push > 0
        assert_exact(head, reference, ids, boundaries(session, outputs[-1], 1))


async def test_a_rewind_replaces_a_server_and_the_session_goes_on_from_there(network, head, reference):
    chain = await three_hops(network)
    client = network.client()
    async with InferenceSession(client.swarm, None, 32) as session:
        await decode(session, head, torch.cat([PROMPT, LATER], dim=1))
        replacement = await network.add_server((2, 4))
        await session.arepair(7, [chain[1].peer_id])  # as if a check found position 7 wrong there
        assert session.position == 7 and replacement.peer_id in {hop.peer_id for hop in session.route}
        assert all(link.history.length == 7 for link in session.chain.links)
        other = torch.randint(3, 300, (2, 3), generator=torch.Generator().manual_seed(5))
        outputs = await session.astep(head.embed(other))
        ids = torch.cat([PROMPT[:, :7], other], dim=1)
        assert_exact(head, reference, ids, boundaries(session, outputs, 3))


async def test_a_frozen_server_times_out_and_is_replaced(network, head, reference):
    chain = await three_hops(network)
    client = network.client(request_timeout=1.0)
    ids = torch.cat([PROMPT, LATER[:, :1]], dim=1)
    async with InferenceSession(client.swarm, None, 32) as session:
        await session.astep(head.embed(PROMPT))
        await network.add_server((4, 6))
        chain[2].freeze()
        outputs = await session.astep(head.embed(LATER[:, :1]))
        assert session.num_failovers == 1 and chain[2].peer_id not in {hop.peer_id for hop in session.route}
        assert_exact(head, reference, ids, boundaries(session, outputs, 1))
        chain[2].kill()


async def test_a_server_silent_for_many_times_its_step_time_is_replaced_before_the_timeout(
    network, head, reference
):
    chain = await three_hops(network)
    client = network.client(request_timeout=40.0)
    ids = torch.cat([PROMPT, LATER], dim=1)
    async with InferenceSession(client.swarm, None, 32) as session:
        await decode(session, head, ids[:, :12])  # three decode steps: each hop's pace is known
        await network.add_server((4, 6))
        chain[2].freeze()
        # replaced after a few seconds of silence (estimates.silence_limit), not the 40 s timeout
        outputs = await asyncio.wait_for(session.astep(head.embed(ids[:, 12:13])), 20.0)
        assert session.num_failovers == 1 and chain[2].peer_id not in {hop.peer_id for hop in session.route}
        assert_exact(head, reference, ids[:, :13], boundaries(session, outputs, 1))
        chain[2].kill()


async def test_a_busy_server_that_answers_pings_is_waited_for(network, head, reference):
    chain = await three_hops(network)
    client = network.client()
    ids = torch.cat([PROMPT, LATER], dim=1)
    async with InferenceSession(client.swarm, None, 32) as session:
        await decode(session, head, ids[:, :12])
        await network.add_server((4, 6))
        chain[2].spans.primary.engine.pass_delay = 3.0  # suddenly slow (loaded), but alive
        outputs = await session.astep(head.embed(ids[:, 12:13]))
        assert session.num_failovers == 0 and chain[2].peer_id in {hop.peer_id for hop in session.route}
        assert_exact(head, reference, ids[:, :13], boundaries(session, outputs, 1))


@contextlib.asynccontextmanager
async def last_hop_with_a_replica(network, head):
    """A session 12 tokens into a 3-hop chain (request timeout 60 s), the last hop's blocks on a second
    server too: (the chain, the session, the token ids)."""
    chain = await three_hops(network)
    client = network.client(request_timeout=60.0)
    ids = torch.cat([PROMPT, LATER], dim=1)
    async with InferenceSession(client.swarm, None, 32) as session:
        await decode(session, head, ids[:, :12])
        await network.add_server((4, 6))
        yield chain, session, ids


async def test_a_busy_server_that_hangs_after_answering_a_ping_is_replaced(network, head, reference):
    """Pinged while busy, it answers, so the step waits on; it then hangs, misses the next ping, and is
    replaced long before the request timeout."""
    async with last_hop_with_a_replica(network, head) as (chain, session, ids):
        chain[2].spans.primary.engine.pass_delay = 6.0  # busy for far longer than its pace
        asyncio.get_running_loop().call_later(2.5, chain[2].freeze)  # after answering a ping or two
        outputs = await asyncio.wait_for(session.astep(head.embed(ids[:, 12:13])), 20.0)
        assert session.num_failovers == 1 and chain[2].peer_id not in {hop.peer_id for hop in session.route}
        assert_exact(head, reference, ids[:, :13], boundaries(session, outputs, 1))
        chain[2].kill()


async def test_a_server_that_answers_pings_but_runs_no_pass_is_replaced(
    network, head, reference, monkeypatch
):
    """Its compute is stuck (a hung driver or engine thread; a peer that takes sessions and never computes)
    while its event loop answers every ping: once it has run no pass for STUCK_LIMITS silence limits (at
    least STUCK_FLOOR; here 4 and 3 s, for a shorter test than 16 and 10 s) with the step waiting, the
    step moves, long before the request timeout (failed before: 60 s)."""
    monkeypatch.setattr(stall_probe, "STUCK_LIMITS", 4)
    monkeypatch.setattr(stall_probe, "STUCK_FLOOR", 3.0)
    async with last_hop_with_a_replica(network, head) as (chain, session, ids):
        hold = threading.Event()
        stuck = asyncio.ensure_future(chain[2].spans.primary.engine.call(hold.wait))  # its engine waits
        try:
            started = time.monotonic()
            outputs = await asyncio.wait_for(session.astep(head.embed(ids[:, 12:13])), 45.0)
            assert stall_probe.STUCK_FLOOR <= time.monotonic() - started < 40.0
        finally:
            hold.set()
            await stuck
        assert session.num_failovers == 1 and chain[2].peer_id not in {hop.peer_id for hop in session.route}
        assert_exact(head, reference, ids[:, :13], boundaries(session, outputs, 1))


async def test_without_a_replica_the_step_fails_naming_the_blocks(network, head):
    chain = await three_hops(network)
    client = network.client(routing_timeout=0.5)
    async with InferenceSession(client.swarm, None, 32) as session:
        await session.astep(head.embed(PROMPT))
        chain[1].kill()
        with pytest.raises(MissingBlocks, match="no server available for blocks 2-3"):
            await session.astep(head.embed(LATER[:, :1]))


class Replies:
    """A stream whose server sends prepared replies (the SpanStream's side of the wire)."""

    def __init__(self, replies):
        self.sent, self.replies, self.closed = [], list(replies), False

    async def send(self, message):
        self.sent.append(message)

    async def receive(self, message_type):
        return self.replies.pop(0) if self.replies else None

    async def end(self):
        pass

    def close(self):
        self.closed = True


def reply(step_id, outputs=None, error=None):
    tensors = [] if outputs is None else [wire_tensors.serialize(outputs)]
    return runtime_pb2.ExpertResponse(tensors=tensors, metadata=StepReply(step_id, error=error).to_bytes())


async def test_a_skipped_step_is_a_reply_and_the_stream_goes_on():
    """A server that ran nothing for a frame of a dropped epoch says so: the client reads StepSkipped for
    that step, and the stream takes the next one (it used to be closed, and the server failed over)."""
    hidden = torch.randn(1, 2, 8)
    skipped = runtime_pb2.ExpertResponse(metadata=StepReply("old", skipped=True).to_bytes())
    wire = Replies([skipped, reply("now", hidden * 2)])
    stream = SpanStream(wire, Hop("p", 0, 2), "uid", Opening(16), "lossless", 1.0)
    with pytest.raises(StepSkipped):
        await stream.step(Step(hidden, 0), StepRoute("old"))
    assert not stream.closed and not wire.closed
    result = await stream.step(Step(hidden, 0), StepRoute("now"))
    assert torch.equal(result.outputs, hidden * 2)


async def test_a_span_stream_skips_replies_to_abandoned_steps_and_refuses_bad_ones():
    hidden = torch.randn(1, 2, 8)
    stale, good = reply("old", torch.zeros(1, 2, 8)), reply("now", hidden * 2)
    stream = SpanStream(Replies([stale, good]), Hop("p", 0, 2), "uid", Opening(16), "lossless", 1.0)
    result = await stream.step(Step(hidden, 0), StepRoute("now"))
    assert torch.equal(result.outputs, hidden * 2) and not stream.closed
    for bad, why in [
        (reply("now", error="position 3 is not 2"), "refused a step"),
        (reply("now", torch.zeros(1, 3, 8)), "shape"),
        (runtime_pb2.ExpertResponse(metadata=b"\xff"), "malformed reply"),
        (None, "closed the stream"),
    ]:
        wire = Replies([bad] if bad is not None else [])
        stream = SpanStream(wire, Hop("p", 0, 2), "uid", Opening(16), "lossless", 1.0)
        with pytest.raises(ServerUnavailable, match=why):
            await stream.step(Step(hidden, 0), StepRoute("now"))
        assert stream.closed and wire.closed  # a failed stream takes no more steps


async def test_a_span_stream_takes_only_the_reply_that_names_what_it_sent():
    """Replies to the awaited step id that name other inputs or another position (a pushed copy the
    client never sent ran first) are skipped and counted; a reply naming no inputs is taken as before."""
    hidden = torch.randn(1, 1, 8)
    sent = step_digest([wire_tensors.serialize(hidden)]).hex()
    other = step_digest([wire_tensors.serialize(hidden + 1)]).hex()

    def ran(outputs, position, inputs):
        metadata = StepReply("now", position=position, inputs=inputs).to_bytes()
        return runtime_pb2.ExpertResponse(tensors=[wire_tensors.serialize(outputs)], metadata=metadata)

    forged, elsewhere, good = ran(hidden * 3, 4, other), ran(hidden * 5, 5, sent), ran(hidden * 2, 4, sent)
    stream = SpanStream(
        Replies([forged, elsewhere, good]), Hop("p", 0, 2), "uid", Opening(16), "lossless", 1.0
    )
    result = await stream.step(Step(hidden, 4), StepRoute("now"))
    assert torch.equal(result.outputs, hidden * 2) and result.num_foreign == 2
    stream = SpanStream(
        Replies([reply("now", hidden * 7)]), Hop("p", 0, 2), "uid", Opening(16), "lossless", 1.0
    )
    result = await stream.step(Step(hidden, 4), StepRoute("now"))
    assert torch.equal(result.outputs, hidden * 7) and result.num_foreign == 0


async def test_a_banned_server_is_never_routed_to_until_its_ban_ends(network):
    fast, other = await network.add_server((0, 6)), await network.add_server((0, 6))
    client = network.client(ban_time=2.0)  # ten routes take milliseconds, even on a loaded machine
    client.swarm.bans.ban(fast.peer_id)
    for _ in range(10):
        assert await client.swarm.router.route() == [Hop(other.peer_id, 0, 6)]
    await asyncio.sleep(2.1)
    await client.swarm.view.refresh()  # pinged again once no longer banned
    seen = {(await client.swarm.router.route())[0].peer_id for _ in range(30)}
    assert seen == {fast.peer_id, other.peer_id}  # equal replicas, chosen at random again


@pytest.mark.parametrize("reachability", ["relayed", "direct"])
async def test_a_lost_connection_to_a_relayed_server_is_made_again_without_a_ban(
    network, head, reference, reachability
):
    """A relay ends the connections it relays at its time and data limits: the server lives, only the path
    broke. A relayed server's lost connection (its streams cut, the server alive) is made again at once and
    replayed there, exactly, without a ban; a server reached directly is banned for the same, and its blocks
    wait for the ban to end or for another server."""
    chain = await three_hops(network)
    chain[1].status.reach = SimpleNamespace(reachability=reachability, paths=())  # as its record says
    client = network.client(routing_timeout=0.5)
    ids = torch.cat([PROMPT, LATER], dim=1)
    async with InferenceSession(client.swarm, None, 32) as session:
        await session.astep(head.embed(PROMPT))
        await client.swarm.view.refresh()  # its record, with how it is reached
        for stream in list(chain[1].streams):
            stream.cut()
        if reachability == "direct":
            with pytest.raises(MissingBlocks, match="no server available for blocks 2-3"):
                await session.astep(head.embed(ids[:, 9:10]))
            assert chain[1].peer_id in client.swarm.bans.banned()
            return
        outputs = [await session.astep(head.embed(ids[:, i : i + 1])) for i in range(9, ids.shape[1])]
        assert session.num_failovers == 1 and chain[1].peer_id not in client.swarm.bans.banned()
        assert [hop.peer_id for hop in session.route] == [server.peer_id for server in chain]
        assert_exact(head, reference, ids, boundaries(session, outputs[-1], 1))
