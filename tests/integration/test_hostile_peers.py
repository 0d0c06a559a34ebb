"""Hostile peers against a real 2-server swarm: other clients' sessions stay theirs, floods leave room.

A raw hivemind peer (the attacker) knows the victim's session ids, as any server of a chain does, and
tries to read or corrupt the victim's session by pushing into it, directly or relayed by an honest
server; and it floods a server with sessions. The honest client meanwhile produces exactly the
reference model's logits and tokens.
"""

from __future__ import annotations

import asyncio

import msgpack
import psutil
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError, P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.launch.local import LocalSwarm
from corolla.wire import tensors
from corolla.wire.messages import RPC_INFERENCE, RPC_INFO, RPC_PUSH
from corolla.wire.records import ServerStatus, block_uids
from swarm_helpers import connect, reference_generate, wait_until
from tiny_models import load_reference

HIDDEN = 64
MAX_SESSIONS_PER_PEER = 6
FIRST_UID, SECOND_UID = block_uids("tiny-llama", 0, 3), block_uids("tiny-llama", 3, 6)
# 6 pages of 16 positions on the first server: the flooder's sessions fill it
SERVER_ARGS = ["--max-cache-tokens", "96", "--max-sessions-per-peer", str(MAX_SESSIONS_PER_PEER)]


@pytest.fixture(scope="module")
def pair(tiny_models):
    with LocalSwarm(str(tiny_models["llama"]), [(0, 3), (3, 6)], server_args=SERVER_ARGS) as swarm:
        yield swarm


@pytest.fixture
async def attacker(pair):
    """A raw peer that records every push that reaches it."""
    p2p = await P2P.create(
        initial_peers=pair.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False
    )
    received: list[runtime_pb2.ExpertRequest] = []

    async def rpc_push(requests, context):
        async for request in requests:
            received.append(request)
        return
        yield

    await p2p.add_protobuf_handler(
        RPC_PUSH, rpc_push, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
    )

    async def reachable() -> bool:  # a fresh daemon finds the servers once it has bootstrapped its routing
        try:
            for server in pair.servers:
                await server_info(p2p, server.peer_id)
            return True
        except P2PDaemonError:
            return False

    assert await wait_until(reachable, timeout=15)
    yield p2p, received
    await p2p.shutdown()


async def server_info(p2p, peer_id: str) -> ServerStatus:
    reply = await p2p.call_protobuf_handler(
        PeerID.from_base58(peer_id), RPC_INFO, runtime_pb2.ExpertUID(uid=""), runtime_pb2.ExpertInfo
    )
    return ServerStatus.from_bytes(reply.serialized_info)


def message(uid, hidden, extra=(), **fields):
    protos = [tensors.serialize(hidden), *extra]
    return runtime_pb2.ExpertRequest(uid=uid, tensors=protos, metadata=msgpack.packb(fields))


class RawSession:
    """An rpc_inference stream of the attacker's, kept open until closed."""

    def __init__(self, p2p, peer_id):
        self.p2p, self.peer = p2p, PeerID.from_base58(peer_id)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.replies = None

    async def step(self, request):
        await self.queue.put(request)
        if self.replies is None:
            self.replies = await self.p2p.iterate_protobuf_handler(
                self.peer, RPC_INFERENCE, self._requests(), runtime_pb2.ExpertResponse
            )
        return await asyncio.wait_for(anext(self.replies), 20)

    async def _requests(self):
        while (request := await self.queue.get()) is not None:
            yield request

    async def close(self):
        await self.queue.put(None)
        if self.replies is not None:
            async for _ in self.replies:
                pass


async def push(p2p, peer_id, request):
    async def one():
        yield request

    stream = await p2p.iterate_protobuf_handler(
        PeerID.from_base58(peer_id), RPC_PUSH, one(), runtime_pb2.ExpertResponse
    )
    return [reply async for reply in stream]


async def test_no_peer_can_push_into_another_clients_session(pair, attacker, tiny_models):
    p2p, received = attacker
    me = p2p.peer_id.to_base58()
    first, second = (s.peer_id for s in pair.servers)
    ids = torch.randint(3, 300, (1, 8), generator=torch.Generator().manual_seed(1))
    rss_before = [psutil.Process(s.pid).memory_info().rss for s in pair.servers]
    model = await asyncio.to_thread(connect, tiny_models["llama"], pair)
    try:
        session = model.inference_session(max_length=16)
        await asyncio.to_thread(session.open)
        outputs = [await asyncio.to_thread(session.step, model.head.embed(ids[:, :5]))]
        assert [hop.peer_id for hop in session.route] == [first, second]
        victim_id, position = session.chain.links[1].stream.session_id, session.position
        victim_peer = model.client.p2p.peer_id.to_base58()
        hostile = torch.randn(1, 1, HIDDEN) * 10
        sink = [[me, "sink", 0, 1]]
        fields = dict(step_id="x1", start_from_position=position, session_id=victim_id, pushed=True)
        # 1. straight to the victim's second server, claiming to relay the victim's own chain
        assert (
            await push(
                p2p, second, message(SECOND_UID, hostile, next_servers=sink, origin=victim_peer, **fields)
            )
            == []
        )
        # 3. with deep prompts that would replace the session's
        prompts = [tensors.serialize(torch.randn(3, 1, 2, HIDDEN))]
        with pytest.raises(P2PHandlerError, match="hidden_states only"):
            await push(p2p, second, message(SECOND_UID, hostile, prompts, origin=victim_peer, **fields))
        # 2. relayed by the honest first server: our own session there pushes into the victim's
        relay = RawSession(p2p, first)
        await relay.step(message(FIRST_UID, torch.randn(1, position, HIDDEN), max_length=16))
        hops = [[second, victim_id, 3, 6], *sink]
        reply = await relay.step(
            message(FIRST_UID, hostile, step_id="x2", start_from_position=position, next_servers=hops)
        )
        assert reply.tensors  # the first server ran our step and pushed it on: the second refuses it
        await relay.close()
        await asyncio.sleep(1.0)
        assert received == []  # nothing computed over the victim's cache ever reached us
        for i in range(5, 8):
            outputs.append(await asyncio.to_thread(session.step, model.head.embed(ids[:, i : i + 1])))
        logits = model.head.logits(torch.cat(outputs, dim=1))
        with torch.no_grad():
            expected = load_reference(tiny_models["llama"])(ids).logits
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        await asyncio.to_thread(session.close)
    finally:
        await asyncio.to_thread(model.shutdown)
    grown = [
        psutil.Process(s.pid).memory_info().rss - b for s, b in zip(pair.servers, rss_before, strict=True)
    ]
    assert all(g < 100 * 2**20 for g in grown), f"server RSS grew by {[g >> 20 for g in grown]} MiB"


async def test_a_flooding_peer_leaves_room_for_an_honest_client(pair, attacker, tiny_models):
    p2p, _ = attacker
    first = pair.servers[0].peer_id
    flood = [RawSession(p2p, first) for _ in range(MAX_SESSIONS_PER_PEER)]
    try:
        for session in flood:  # one 16-position page each: the whole cache of the first server
            await session.step(message(FIRST_UID, torch.randn(1, 16, HIDDEN), max_length=32))
        extra = RawSession(p2p, first)
        with pytest.raises(P2PHandlerError, match=f"max_sessions_per_peer={MAX_SESSIONS_PER_PEER}"):
            await extra.step(message(FIRST_UID, torch.randn(1, 1, HIDDEN), max_length=32))
        prompt = torch.randint(3, 300, (1, 6), generator=torch.Generator().manual_seed(2))
        with connect(tiny_models["llama"], pair, max_retries=1) as model:
            tokens = await asyncio.to_thread(model.generate, prompt, max_new_tokens=8, ignore_eos=True)
        reference = load_reference(tiny_models["llama"])
        assert torch.equal(tokens, reference_generate(reference, prompt, max_new_tokens=8))
        # the flooder's preempted session recomputes its cache and goes on
        assert (
            await flood[0].step(message(FIRST_UID, torch.randn(1, 1, HIDDEN), start_from_position=16))
        ).tensors
    finally:
        for session in flood:
            await session.close()

    async def cache_is_full():
        status = await server_info(p2p, first)
        return status.num_sessions == 0 and status.cache_tokens_available == status.cache_tokens_total

    assert await wait_until(cache_is_full, timeout=10)
