"""Malformed requests get precise errors and harm no one; vanished clients free what they held.

A raw hivemind peer sends each bad request to a real server while a well-formed session (through the
corolla client) keeps stepping on the same server; that session must still produce the reference
model's logits, and the server's free cache must return to its full size afterwards.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import msgpack
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError, P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.errors import InvalidRequest
from corolla.launch.local import LocalSwarm
from corolla.wire import tensors
from corolla.wire.messages import (
    RPC_BACKWARD,
    RPC_BACKWARD_STREAM,
    RPC_FORWARD,
    RPC_FORWARD_STREAM,
    RPC_INFERENCE,
    RPC_INFO,
    RPC_PUSH,
    StepReply,
)
from corolla.wire.records import ServerStatus
from swarm_helpers import connect, wait_until
from tiny_models import load_reference

HIDDEN = 64
FULL_UID = " ".join(f"tiny-llama.{i}" for i in range(6))  # cache costs are counted over all 6 blocks
LIMITS = [
    "--inference-max-length",
    "64",
    "--max-batch-size",
    "4",
    "--max-cache-tokens",
    "200",
    "--max-forward-tokens",
    "128",
    "--step-timeout",
    "4",
    "--max-tree-tokens",
    "8",
]


@pytest.fixture(scope="module")
def guarded_swarm(tiny_models):
    with LocalSwarm(str(tiny_models["llama"]), [(0, 6)], server_args=LIMITS) as swarm:
        yield swarm


@pytest.fixture
async def raw_peer(guarded_swarm):
    p2p = await P2P.create(
        initial_peers=guarded_swarm.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False
    )
    peer = PeerID.from_base58(guarded_swarm.servers[0].peer_id)

    async def reachable() -> bool:  # a fresh daemon finds the server once it has bootstrapped its routing
        try:
            return bool(await server_info(p2p, peer))
        except P2PDaemonError:
            return False

    assert await wait_until(reachable, timeout=15)
    yield p2p, peer
    await p2p.shutdown()


def meta(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def request(uid="tiny-llama.0 tiny-llama.1", hidden=None, metadata=None, extra=()):
    hidden = torch.randn(1, 2, HIDDEN) if hidden is None else hidden
    protos = ([tensors.serialize(hidden)] if hidden is not False else []) + list(extra)
    return runtime_pb2.ExpertRequest(
        uid=uid, tensors=protos, metadata=meta(max_length=16) if metadata is None else metadata
    )


def corrupted():
    proto = tensors.serialize(torch.randn(1, 2, HIDDEN))
    proto.buffer = proto.buffer[:-4]
    return proto


def overflowing():
    """No element, but strides past int64: torch failed to build it with an untyped RuntimeError."""
    return runtime_pb2.Tensor(size=[0, 2**32 - 1, 2**32 - 1], dtype="float32")


BAD_INFERENCE = {
    "unknown block uid": ([request(uid="other-model.0")], "is not one of this server's blocks"),
    "non-contiguous uids": ([request(uid="tiny-llama.0 tiny-llama.2")], "are not contiguous"),
    "blocks outside the span": ([request(uid="tiny-llama.5 tiny-llama.6")], "outside this server's span 0:6"),
    "missing max_length": ([request(metadata=meta(session_id="x"))], "'max_length' is required"),
    "non-integer max_length": ([request(metadata=meta(max_length="ten"))], "'max_length' must be an integer"),
    "oversized max_length": (
        [request(metadata=meta(max_length=100_000))],
        "max_length=100000 exceeds this server's inference_max_length=64",
    ),
    "steps past max_length": (
        [
            request(metadata=meta(max_length=4), hidden=torch.randn(1, 3, HIDDEN)),
            request(metadata=meta(), hidden=torch.randn(1, 2, HIDDEN)),
        ],
        "goes past the session's max_length=4",
    ),
    "wrong tensor rank": ([request(hidden=torch.randn(2, HIDDEN))], "must have shape [batch, length, 64]"),
    "wrong hidden size": ([request(hidden=torch.randn(1, 2, 32))], "must have shape [batch, length, 64]"),
    "wrong dtype": (
        [request(hidden=torch.ones(1, 2, HIDDEN, dtype=torch.int64))],
        "must be float32, float16 or bfloat16",
    ),
    "batch too large": ([request(hidden=torch.randn(5, 1, HIDDEN))], "batch size 5 is outside 1..4"),
    "garbage metadata": ([request(metadata=b"\xc1\xc1garbage")], "metadata is not valid msgpack"),
    "truncated metadata": (
        [request(metadata=meta(max_length=16, session_id="abcdef")[:-3])],
        "metadata is not valid msgpack",
    ),
    "unknown adapter": (
        [request(metadata=meta(max_length=16, active_adapter="my-lora"))],
        "active_adapter 'my-lora' is not served here",
    ),
    "non-ASCII block digits": (
        [request(uid="tiny-llama.\u0660 tiny-llama.\u0661")],  # Arabic-Indic 0 and 1: \d took them
        "block 'tiny-llama.\u0660' is not one of this server's blocks",
    ),
    "hidden states longer than the session": (  # 4 MiB for 16 tokens: refused from its declared shape
        [request(metadata=meta(max_length=16), hidden=torch.randn(1, 1024, HIDDEN))],
        "hidden_states: length 1024 exceeds the session's max_length=16",
    ),
    "a first message over every session's size": (  # 4 MiB: refused from its length header
        [request(metadata=meta(max_length=16), hidden=torch.randn(1, 16384, HIDDEN))],
        "rpc_inference: a message of 4194372 bytes exceeds this stream's limit of 593952 bytes",
    ),
    "a later step longer than the session": (
        [request(), request(metadata=meta(), hidden=torch.randn(1, 17, HIDDEN))],
        "hidden_states: length 17 exceeds the session's max_length=16",
    ),
    "a later step heavier than any of the session's": (  # refused from its length header
        [request(), request(metadata=meta(), hidden=torch.randn(1, 1024, HIDDEN))],
        "rpc_inference: a message of 262197 bytes exceeds this stream's limit of 163848 bytes",
    ),
    "empty first message": ([request(hidden=False)], "must carry hidden_states"),
    "corrupted tensor buffer": ([request(hidden=False, extra=[corrupted()])], "buffer has 508 bytes"),
    "hypo_ids out of range": (
        [request(extra=[tensors.empty(), tensors.serialize(torch.tensor([3]))])],
        "hypo_ids values must lie in [0, 1)",
    ),
    "rollback past the present": (
        [request(), request(metadata=meta(start_from_position=9))],
        "start_from_position=9 is after the session's current position 2",
    ),
    "a token tree with a cycle": (
        [request(), request(metadata=meta(tree=[-1, 1]))],
        "tree[1]=1: a token cannot be its own parent (a cycle)",
    ),
    "a token tree with a parent out of range": (
        [
            request(),
            request(metadata=meta(tree=[-1, 0, 7], start_from_position=2), hidden=torch.randn(1, 3, HIDDEN)),
        ],
        "tree[2]=7: a parent must come before its child (-1 or 0..1)",
    ),
    "a token tree over the server's limit": (
        [request(), request(metadata=meta(tree=list(range(-1, 8))), hidden=torch.randn(1, 9, HIDDEN))],
        "tree: 1 x 9 tokens exceed this server's max_tree_tokens=8",
    ),
    "a token tree with fewer parents than tokens": (
        [request(), request(metadata=meta(tree=[-1]))],
        "tree: 1 parents for a step of 2 tokens",
    ),
    "an accepted path the tree does not have": (
        [
            request(),
            request(metadata=meta(tree=[-1, -1])),
            request(metadata=meta(accepted=[0, 1], start_from_position=4), hidden=torch.randn(1, 1, HIDDEN)),
        ],
        "accepted=[0, 1] is not a path from a root of the session's last tree",
    ),
    "a token tree of strings": (
        [request(), request(metadata=meta(tree=["a", "b"]))],
        "field 'tree[0]' must be an integer",
    ),
    "batch changes mid-session": (
        [request(), request(metadata=meta(), hidden=torch.randn(2, 1, HIDDEN))],
        "batch size 2 differs from the session's 1",
    ),
    "malformed deep prompts": (
        [request(extra=[tensors.serialize(torch.randn(3, 1, 1, HIDDEN))])],
        "prompts must be empty or a float tensor [2, 1, prefix, 64]",
    ),
    "protocol version from the future": (
        [request(metadata=meta(max_length=16, version=99))],
        "'version' must be <= 1",
    ),
    "more cache than the whole pool": (
        [request(FULL_UID, metadata=meta(max_length=64), hidden=torch.randn(4, 60, HIDDEN))],
        "more than this server's whole cache of 192 tokens",
    ),
    "cache exhausted after alloc_timeout": (
        [
            request(
                FULL_UID, metadata=meta(max_length=64, alloc_timeout=0.3), hidden=torch.randn(3, 60, HIDDEN)
            )
        ],
        "within alloc_timeout",
    ),
}

BAD_FORWARD = {
    "forward with too many tokens": (
        request(hidden=torch.randn(4, 40, HIDDEN), metadata=meta()),
        "4 x 40 tokens exceed max_forward_tokens=128",
    ),
    "forward with a zero-size shape whose strides overflow": (
        request(hidden=False, metadata=meta(), extra=[overflowing()]),
        "InvalidRequest: tensor hidden_states: dimension 4294967295 in [0, 4294967295, 4294967295]",
    ),
    "forward with an unknown compression": (
        request(metadata=meta(output_compression=[3])),
        "output_compression=3 is not supported",
    ),
}


BAD_BACKWARD = {
    "backward without grad_outputs": (request(metadata=meta()), "carries inputs, grad_outputs and prompts"),
    "backward with mis-shaped grad_outputs": (
        request(metadata=meta(), extra=[tensors.serialize(torch.randn(1, 3, HIDDEN))]),
        "grad_outputs must be a float tensor shaped like the inputs [1, 2, 64]",
    ),
    "backward with NaN grad_outputs": (
        request(metadata=meta(), extra=[tensors.serialize(torch.full((1, 2, HIDDEN), float("nan")))]),
        "grad_outputs holds NaN",
    ),
    "backward with mis-shaped prompts": (
        request(
            metadata=meta(),
            extra=[
                tensors.serialize(torch.randn(1, 2, HIDDEN)),
                tensors.serialize(torch.randn(3, 1, 2, HIDDEN)),
            ],
        ),
        "prompts must be empty or a float tensor [2, 1, prefix, 64]",
    ),
}


PUSH_SESSION = "push-target"  # a session opened on blocks 0:2 and stepped to position 2 by the test


def bad_pushes(me: str) -> dict:
    """Malformed pushes from `me`, the peer that opened PUSH_SESSION and named itself as its pusher."""
    own = dict(session_id=PUSH_SESSION, origin=me)
    return {  # the first needs the session; the test sends it at once (sessions live --step-timeout = 4 s)
        "push for other blocks than the session's": (
            request(FULL_UID, metadata=meta(**own, step_id="s", start_from_position=2)),
            "the pushed step's blocks differ from the session's 0:2",
        ),
        "push with garbage metadata": (
            request(metadata=b"\xc1garbage"),
            "rpc_push: metadata is not valid msgpack",
        ),
        "push without a step_id": (
            request(metadata=meta(**own, start_from_position=2)),
            "'step_id' is required",
        ),
        "push without a session_id": (
            request(metadata=meta(step_id="s", start_from_position=2, origin=me)),
            "'session_id' is required",
        ),
        "push without an origin": (
            request(metadata=meta(step_id="s", start_from_position=2, session_id=PUSH_SESSION)),
            "'origin' is required",
        ),
        "push with deep prompts": (
            request(metadata=meta(**own, step_id="s", start_from_position=2), extra=[tensors.empty()]),
            "a pushed step carries hidden_states only",
        ),
    }


async def run_inference(p2p, peer, messages):
    async def requests():
        for message in messages:
            yield message

    stream = await p2p.iterate_protobuf_handler(peer, RPC_INFERENCE, requests(), runtime_pb2.ExpertResponse)
    return [response async for response in stream]


async def inference_error(p2p, peer, messages) -> str:
    """The error a session's messages get: the whole session's (a bad first message, an oversized step),
    or a later step's own error reply (the step is refused, the session goes on)."""
    try:
        responses = await run_inference(p2p, peer, messages)
    except P2PHandlerError as e:
        return str(e)
    errors = [StepReply.from_bytes(r.metadata).error for r in responses]
    assert any(errors), f"no error for {len(messages)} messages: {errors}"
    return next(e for e in errors if e)


async def run_push(p2p, peer, messages):
    async def requests():
        for message in messages:
            yield message

    stream = await p2p.iterate_protobuf_handler(peer, RPC_PUSH, requests(), runtime_pb2.ExpertResponse)
    return [response async for response in stream]


async def server_info(p2p, peer) -> ServerStatus:
    reply = await p2p.call_protobuf_handler(
        peer, RPC_INFO, runtime_pb2.ExpertUID(uid=""), runtime_pb2.ExpertInfo
    )
    return ServerStatus.from_bytes(reply.serialized_info)


async def test_bad_requests_get_precise_errors_and_a_concurrent_session_is_unharmed(
    raw_peer, guarded_swarm, tiny_models
):
    p2p, peer = raw_peer
    full = await server_info(p2p, peer)
    reference = load_reference(tiny_models["llama"])
    input_ids = torch.randint(
        3,
        300,
        (1, len(BAD_INFERENCE) + len(BAD_FORWARD) + len(BAD_BACKWARD) + 1),
        generator=torch.Generator().manual_seed(0),
    )
    model = await asyncio.to_thread(connect, tiny_models["llama"], guarded_swarm)
    try:
        session = model.inference_session(max_length=56)
        await asyncio.to_thread(session.open)
        outputs, position = [], 0

        async def good_step():
            nonlocal position
            hidden = model.head.embed(input_ids[:, position : position + 1])
            outputs.append(await asyncio.to_thread(session.step, hidden))
            position += 1

        await good_step()
        for name, (messages, expected) in BAD_INFERENCE.items():
            error = await inference_error(p2p, peer, messages)
            assert expected in error, f"{name}: {error}"
            await good_step()
        for name, (message, expected) in BAD_FORWARD.items():
            with pytest.raises(P2PHandlerError) as info:
                await p2p.call_protobuf_handler(peer, RPC_FORWARD, message, runtime_pb2.ExpertResponse)
            assert expected in str(info.value), f"{name}: {info.value}"
            await good_step()
        for name, (message, expected) in BAD_BACKWARD.items():
            with pytest.raises(P2PHandlerError) as info:
                await p2p.call_protobuf_handler(peer, RPC_BACKWARD, message, runtime_pb2.ExpertResponse)
            assert expected in str(info.value), f"{name}: {info.value}"
            await good_step()
        with torch.no_grad():
            expected_logits = reference(input_ids).logits
        logits = model.head.logits(torch.cat(outputs, dim=1))
        torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=0)
        await asyncio.to_thread(session.close)
    finally:
        await asyncio.to_thread(model.shutdown)

    async def cache_is_full():
        info = await server_info(p2p, peer)
        return info.cache_tokens_available == full.cache_tokens_total and info.num_sessions == 0

    assert await wait_until(cache_is_full, timeout=5)


async def test_bad_pushes_get_precise_errors_and_a_pushed_step_runs_and_replies_once(raw_peer):
    p2p, peer = raw_peer
    queue: asyncio.Queue = asyncio.Queue()
    hidden = torch.randn(1, 4, HIDDEN, generator=torch.Generator().manual_seed(5))
    me = p2p.peer_id.to_base58()  # the session names us as its pusher: as a client names its previous hop
    (for_session, *bad), expected_errors = zip(*bad_pushes(me).items(), strict=True)
    for name, (message, expected) in zip(bad, expected_errors[1:], strict=True):  # need no session
        with pytest.raises(P2PHandlerError) as info:
            await run_push(p2p, peer, [message])
        assert expected in str(info.value), f"{name}: {info.value}"
    first = meta(max_length=8, session_id=PUSH_SESSION, push_from=me)
    await queue.put(request(hidden=hidden[:, :2], metadata=first))

    async def session_requests():
        while (item := await queue.get()) is not None:
            yield item

    session = await p2p.iterate_protobuf_handler(
        peer, RPC_INFERENCE, session_requests(), runtime_pb2.ExpertResponse
    )
    outputs = [tensors.deserialize((await anext(session)).tensors[0], "outputs")]
    message, expected = expected_errors[0]
    with pytest.raises(P2PHandlerError) as info:
        await run_push(p2p, peer, [message])
    assert expected in str(info.value), f"{for_session}: {info.value}"

    def push(step_id, hidden, session_id=PUSH_SESSION, position=2):
        fields = dict(session_id=session_id, step_id=step_id, start_from_position=position, pushed=True)
        return request(hidden=hidden, metadata=meta(**fields, origin=me))

    before = await server_info(p2p, peer)
    skipped = [
        push("a", hidden[:, 2:3], session_id="no-such-session"),  # not open here: skipped
        push("b", hidden[:, 2:3], position=1),  # not the session's position: skipped
        push("c", False, position=2),  # no tensors: this copy fails, the client's copy of "c" runs it
    ]
    assert await run_push(p2p, peer, skipped) == []  # the stream stays open across them
    await queue.put(request(hidden=hidden[:, 2:3], metadata=meta(step_id="c", push_from=me)))
    reply = await anext(session)
    assert StepReply.from_bytes(reply.metadata).step_id == "c"
    outputs.append(tensors.deserialize(reply.tensors[0], "outputs"))
    assert await run_push(p2p, peer, [push("d", hidden[:, 3:4], position=3)]) == []  # runs the step
    reply = await asyncio.wait_for(anext(session), 10)  # the reply comes before our own copy of "d"
    assert StepReply.from_bytes(reply.metadata).step_id == "d"
    outputs.append(tensors.deserialize(reply.tensors[0], "outputs"))
    await queue.put(
        request(hidden=hidden[:, 3:4], metadata=meta(step_id="d", push_from=me))
    )  # late: no reply
    await queue.put(None)
    assert [r async for r in session] == []
    after = await server_info(p2p, peer)
    assert after.steps_from_push - before.steps_from_push == 1  # "d", by push; "c" from the client
    assert after.steps_from_client - before.steps_from_client == 1

    forward = request(hidden=hidden, metadata=meta())
    whole = await p2p.call_protobuf_handler(peer, RPC_FORWARD, forward, runtime_pb2.ExpertResponse)
    torch.testing.assert_close(
        torch.cat(outputs, dim=1), tensors.deserialize(whole.tensors[0], "outputs"), atol=1e-4, rtol=0
    )


async def test_a_refused_tree_step_leaves_the_session_usable(raw_peer):
    """Malformed speculative steps get error replies; the same session then verifies a tree and keeps its
    path, with the outputs of a plain forward pass over that path."""
    p2p, peer = raw_peer
    queue: asyncio.Queue = asyncio.Queue()
    hidden = torch.randn(1, 6, HIDDEN, generator=torch.Generator().manual_seed(6))
    nodes = torch.randn(1, 3, HIDDEN, generator=torch.Generator().manual_seed(7))

    async def session_requests():
        while (item := await queue.get()) is not None:
            yield item

    await queue.put(request(hidden=hidden[:, :2], metadata=meta(max_length=16)))
    session = await p2p.iterate_protobuf_handler(
        peer, RPC_INFERENCE, session_requests(), runtime_pb2.ExpertResponse
    )
    assert (await anext(session)).tensors
    for bad, expected in [
        (meta(step_id="x", tree=[-1, 2, 0]), "tree[1]=2: a parent must come before its child"),
        (meta(step_id="y", tree=[-1, 0]), "tree: 2 parents for a step of 3 tokens"),
    ]:
        await queue.put(request(hidden=nodes, metadata=bad))
        reply = StepReply.from_bytes((await anext(session)).metadata)
        assert reply.error is not None and expected in reply.error, reply
    await queue.put(request(hidden=nodes, metadata=meta(step_id="t", tree=[-1, -1, 0])))  # paths 0-2 and 1
    await anext(session)
    await queue.put(
        request(hidden=hidden[:, 2:3], metadata=meta(step_id="n", accepted=[0, 2], start_from_position=4))
    )
    outputs = tensors.deserialize((await anext(session)).tensors[0], "outputs")
    await queue.put(None)
    assert [r async for r in session] == []
    path = torch.cat([hidden[:, :2], nodes[:, [0, 2]], hidden[:, 2:3]], dim=1)
    forward = request(hidden=path, metadata=meta())
    whole = await p2p.call_protobuf_handler(peer, RPC_FORWARD, forward, runtime_pb2.ExpertResponse)
    expected = tensors.deserialize(whole.tensors[0], "outputs")[:, -1:]
    torch.testing.assert_close(outputs, expected, atol=1e-4, rtol=0)


async def test_reused_session_id_is_refused_while_the_first_session_lives(raw_peer):
    p2p, peer = raw_peer
    queue: asyncio.Queue = asyncio.Queue()
    await queue.put(request(metadata=meta(max_length=8, session_id="shared-id")))

    async def first_requests():
        while (item := await queue.get()) is not None:
            yield item

    first = await p2p.iterate_protobuf_handler(
        peer, RPC_INFERENCE, first_requests(), runtime_pb2.ExpertResponse
    )
    assert (await anext(first)).tensors  # the first session is open and stepped
    with pytest.raises(P2PHandlerError, match="session_id 'shared-id' is already in use"):
        await run_inference(p2p, peer, [request(metadata=meta(max_length=8, session_id="shared-id"))])
    await queue.put(None)
    assert [r async for r in first] == []


def test_client_sees_typed_errors(guarded_swarm, tiny_models):
    with (
        connect(tiny_models["llama"], guarded_swarm) as model,
        # refused by the client before anything is sent: every server announces its limit
        pytest.raises(InvalidRequest, match=r"max_length=500 exceeds the inference_max_length .*at most 64"),
        model.inference_session(max_length=500) as session,
    ):
        session.step(torch.randn(1, 2, HIDDEN))


async def test_hung_client_is_dropped_after_step_timeout(raw_peer):
    p2p, peer = raw_peer
    full = (await server_info(p2p, peer)).cache_tokens_total
    queue: asyncio.Queue = asyncio.Queue()
    await queue.put(request(FULL_UID, metadata=meta(max_length=50)))

    async def requests():
        while (item := await queue.get()) is not None:
            yield item

    stream = await p2p.iterate_protobuf_handler(peer, RPC_INFERENCE, requests(), runtime_pb2.ExpertResponse)
    await anext(stream)
    started = time.monotonic()
    assert (await server_info(p2p, peer)).cache_tokens_available == full - 16  # one block of 16 positions
    with pytest.raises(P2PHandlerError, match="no request arrived within step_timeout=4.0s"):
        await anext(stream)  # we never send the next step
    assert 3.0 < time.monotonic() - started < 10

    async def freed() -> bool:  # the engine's loop thread frees the pages at its next command
        return (await server_info(p2p, peer)).cache_tokens_available == full

    assert await wait_until(freed, timeout=5)
    await queue.put(None)


async def open_raw(p2p, peer, rpc, *frames: bytes):
    """A stream to the server written byte by byte: whole messages, or a frame cut short."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer, rpc)
    writer.write(b"".join(frames))
    await writer.drain()
    return reader, writer


def frame(message) -> bytes:
    body = message.SerializeToString()
    return P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


HALF_A_FRAME = P2P.MESSAGE_MARKER + (10_000).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\x00" * 100


async def error_from(reader, timeout: float = 15, since: float | None = None) -> tuple[str, float]:
    """The error the server ends a stream with, and how long it took to come (from `since` if given)."""
    started = time.monotonic() if since is None else since
    response, error = await asyncio.wait_for(
        P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader), timeout
    )
    return (error.message if error is not None else f"a reply: {response}"), time.monotonic() - started


async def test_idle_streams_are_closed_within_the_step_timeout(raw_peer):
    p2p, peer = raw_peer
    cases = {
        "idle forward stream": (RPC_FORWARD_STREAM,),
        "backward stream cut mid-frame": (RPC_BACKWARD_STREAM, HALF_A_FRAME),
        "forward stream idle after its first chunk": (RPC_FORWARD_STREAM, frame(request(metadata=meta()))),
        "idle push stream": (RPC_PUSH,),
        "push stream cut mid-frame": (RPC_PUSH, HALF_A_FRAME),
    }
    streams, opened = {}, {}
    for name, (rpc, *frames) in cases.items():  # each stream's wait counts from its own opening
        opened[name] = time.monotonic()
        streams[name] = await open_raw(p2p, peer, rpc, *frames)
    results = await asyncio.gather(
        *(error_from(reader, since=opened[name]) for name, (reader, _) in streams.items())
    )
    for name, (error, waited) in zip(streams, results, strict=True):
        assert "SessionTimeout: no request arrived within step_timeout=4.0s" in error, f"{name}: {error}"
        assert 3.5 < waited < 8, f"{name}: closed after {waited:.1f}s"
    for _, writer in streams.values():
        writer.close()


async def test_streams_announcing_too_many_chunks_or_sending_empty_messages_are_refused_at_once(raw_peer):
    p2p, peer = raw_peer
    huge = runtime_pb2.Tensor(chunks=2**31 - 1, size=[1, 2, HIDDEN], dtype="float32", buffer=b"\x00" * 512)
    first = tensors.serialize(torch.randn(1, 2, HIDDEN))
    first.chunks = 2  # announces one more chunk, which never comes: empty messages do
    head = dict(uid="tiny-llama.0 tiny-llama.1", metadata=meta())
    streams = {
        "2**31-1 chunks announced": (
            await open_raw(
                p2p, peer, RPC_FORWARD_STREAM, frame(runtime_pb2.ExpertRequest(tensors=[huge], **head))
            ),
            "its first chunk announces 2147483647 chunks; a stream of at most 262144 bytes here",
        ),
        "empty messages": (
            await open_raw(
                p2p,
                peer,
                RPC_BACKWARD_STREAM,
                frame(runtime_pb2.ExpertRequest(tensors=[first], **head)),
                frame(runtime_pb2.ExpertRequest()) * 10_000,
            ),
            "InvalidRequest: stream: a message after 1 chunks carries no tensors",
        ),
    }
    results = await asyncio.gather(*(error_from(reader, timeout=3) for (reader, _), _ in streams.values()))
    for (name, (_, expected)), (error, waited) in zip(streams.items(), results, strict=True):
        assert expected in error, f"{name}: {error}"
        assert waited < 2, f"{name}: refused after {waited:.1f}s"  # the error drain is 0.5 s
    for (_, writer), _ in streams.values():
        writer.close()


async def test_an_oversized_push_is_refused_before_it_is_decoded(raw_peer):
    p2p, peer = raw_peer
    full = await server_info(p2p, peer)
    fields = meta(session_id="anyone", step_id="s", start_from_position=0, origin="someone", pushed=True)
    with pytest.raises(P2PHandlerError, match="hidden_states: length 65 exceeds inference_max_length=64"):
        await run_push(p2p, peer, [request(hidden=torch.randn(1, 65, HIDDEN), metadata=fields)])
    with pytest.raises(
        P2PHandlerError, match="rpc_push: a message of 256125 bytes exceeds this stream's limit"
    ):
        await run_push(p2p, peer, [request(hidden=torch.randn(1, 1000, HIDDEN), metadata=fields)])

    async def untouched() -> bool:  # the server serves on, its cache free (an earlier test's, once freed)
        after = await server_info(p2p, peer)
        return after.cache_tokens_available == full.cache_tokens_total and after.num_sessions == 0

    assert await wait_until(untouched, timeout=5)


async def test_an_oversized_step_is_refused_from_its_header_and_refusals_log_one_line(
    raw_peer, guarded_swarm
):
    """A 64 MB step for a max_length=16 session: refused from its length header, before its body arrives
    (only 1 KB of it is sent), at once; the server serves on; its log holds one line per refusal."""
    p2p, peer = raw_peer
    server = guarded_swarm.servers[0]
    log_before = len(server.log())
    announced = 64 * 2**20
    session = frame(request(metadata=meta(max_length=16)))
    heavy = frame(request(hidden=torch.randn(1, 1, HIDDEN), metadata=meta(step_id="big")))
    head = heavy[:1] + announced.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + heavy[9:] + bytes(1024)
    reader, writer = await open_raw(p2p, peer, RPC_INFERENCE, session, head)
    message, waited = await error_from(reader, timeout=10)
    if message.startswith("a reply"):  # the first step's reply, unless the refusal overtook it
        message, waited = await error_from(reader, timeout=10)
    assert f"rpc_inference: a message of {announced} bytes exceeds this stream's limit of" in message
    assert waited < 2, f"refused after {waited:.1f}s"  # the step timeout is 4 s: not a timeout
    writer.close()
    error = await inference_error(p2p, peer, [request(), request(metadata=meta(step_id="t", tree=["a"]))])
    assert "field 'tree[0]' must be an integer" in error
    assert await server_info(p2p, peer)  # serving on

    await asyncio.sleep(1)  # the server's log is written by another process
    log = server.log()[log_before:]
    assert "Traceback" not in log and "Handler failed" not in log, log
    # one line for the oversized step (unless earlier tests' refusals used up the minute's lines); the
    # tree step's refusal is a reply, not a log line
    assert log.count("Refused rpc_inference") <= 1, log


CLIENT_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from corolla.client.model import DistributedModelForCausalLM
    from corolla.config import ClientConfig, SwarmConfig

    swarm = SwarmConfig(initial_peers=tuple(sys.argv[2:]), host="127.0.0.1", nat_port_map=False,
                        client_mode=True)
    model = DistributedModelForCausalLM.from_pretrained(sys.argv[1], config=ClientConfig(swarm=swarm))
    session = model.inference_session(max_length=60).open()
    session.step(torch.randn(1, 3, 64))
    print("STEPPED", flush=True)
    time.sleep(600)
""")


async def test_killed_client_frees_its_cache(raw_peer, guarded_swarm, tiny_models, tmp_path):
    p2p, peer = raw_peer
    full = (await server_info(p2p, peer)).cache_tokens_total
    log = open(tmp_path / "client.log", "w+")  # noqa: SIM115 (the child writes to it until the finally)
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT_SCRIPT, str(tiny_models["llama"]), *guarded_swarm.initial_peers],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        for _ in range(600):
            if "STEPPED" in (tmp_path / "client.log").read_text():
                break
            assert client.poll() is None, (tmp_path / "client.log").read_text()
            await asyncio.sleep(0.1)
        assert (await server_info(p2p, peer)).cache_tokens_available == full - 16  # 3 positions: one block
        os.kill(client.pid, signal.SIGKILL)  # the client process dies without a word
        killed = time.monotonic()

        async def freed():
            return (await server_info(p2p, peer)).cache_tokens_available == full

        assert await wait_until(freed, timeout=8)
        assert time.monotonic() - killed < 8  # well within the session's step timeout + slack
    finally:
        try:
            os.killpg(client.pid, signal.SIGKILL)  # its DHT process and daemon, orphaned by the kill
        except ProcessLookupError:
            pass
        client.wait()
        log.close()
