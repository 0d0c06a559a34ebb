"""Raw inference steps sent to a real server (in process, tests/loopback.py) as a hostile or broken peer
would: a later step whose metadata has the wrong types is refused on its own and the session goes on; a
step heavier than its session allows is refused from its size alone."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch
from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.wire import tensors
from corolla.wire.messages import RPC_INFERENCE, StepReply
from loopback import LoopbackNetwork

HIDDEN = 64  # the tiny llama's
UID = "tiny.0 tiny.1"


def step(hidden: torch.Tensor, **fields) -> runtime_pb2.ExpertRequest:
    metadata = msgpack.packb(fields, use_bin_type=True)
    return runtime_pb2.ExpertRequest(uid=UID, tensors=[tensors.serialize(hidden)], metadata=metadata)


async def reply(stream) -> runtime_pb2.ExpertResponse:
    response = await asyncio.wait_for(stream.receive(runtime_pb2.ExpertResponse), 30)
    assert response is not None, "the session ended"
    return response


@pytest.fixture
async def session(tiny_models):
    """A session of max_length 16 on blocks 0:2, its first step (2 tokens) taken."""
    network = LoopbackNetwork(tiny_models["llama"])
    server = await network.add_server((0, 2))
    stream = await network.transport("raw-peer").open_stream(server.peer_id, RPC_INFERENCE)
    hidden = torch.randn(1, 8, HIDDEN, generator=torch.Generator().manual_seed(0))
    await stream.send(step(hidden[:, :2], max_length=16, step_id="first"))
    assert (await reply(stream)).tensors
    yield stream, hidden, server
    stream.close()
    await network.close()


BAD_TREES = {
    "strings": ["a", "b"],
    "floats": [-1.0, 0.5],
    "an empty list": [],
    "a map": {"0": -1},
    "a string": "-1 0",
    "a nested list": [[-1], [0]],
}


async def test_later_steps_with_mistyped_trees_are_refused_and_the_session_goes_on(session):
    stream, hidden, _ = session
    for name, tree in BAD_TREES.items():
        await stream.send(step(hidden[:, 2:4], step_id=name, start_from_position=2, tree=tree))
        refused = await reply(stream)
        meta = StepReply.from_bytes(refused.metadata)
        assert not refused.tensors and meta.step_id == name, f"{name}: {meta}"
        assert meta.error is not None and "tree" in meta.error, f"{name}: {meta.error}"
    await stream.send(step(hidden[:, 2:4], step_id="mistyped accepted", accepted="all"))
    assert "accepted" in StepReply.from_bytes((await reply(stream)).metadata).error
    await stream.send(step(hidden[:, 2:4], step_id="tree", start_from_position=2, tree=[-1, 0]))
    good = await reply(stream)  # the session is where it was: the same two tokens now run as a chain
    answer = StepReply.from_bytes(good.metadata)
    assert (answer.step_id, answer.error, answer.position) == ("tree", None, 2) and good.tensors


async def test_a_step_without_a_readable_step_id_still_ends_the_session(session):
    stream, hidden, _ = session
    await stream.send(step(hidden[:, 2:3], step_id=7, tree=["a"]))  # no reply could name this step
    with pytest.raises(P2PHandlerError, match="'step_id' must be a string"):
        await reply(stream)


async def test_a_step_heavier_than_its_session_allows_is_refused_by_its_size(session):
    stream, hidden, server = session
    cap = server.message_caps[RPC_INFERENCE]
    assert cap > 64 * 2**20, "the server-wide cap admits a 64 MB step; the session's must not"
    heavy = runtime_pb2.ExpertRequest(uid=UID, tensors=[runtime_pb2.Tensor(buffer=bytes(64 * 2**20))])
    await stream.send(heavy)
    with pytest.raises(P2PHandlerError, match=r"a message of \d+ bytes exceeds the limit of \d+"):
        await reply(stream)
