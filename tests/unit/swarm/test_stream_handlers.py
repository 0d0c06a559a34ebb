"""A server's stream handlers on hivemind's wire format (swarm/p2p/stream_handlers.py), driven byte by byte
without a daemon: a message over its stream's cap is refused from its length header, before its body
arrives; a handler's error reaches the caller, and the log as one line, rate-limited."""

from __future__ import annotations

import asyncio
import logging

import pytest
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from corolla.errors import InvalidRequest, WireError
from corolla.swarm.p2p import stream_handlers
from corolla.swarm.p2p.stream_handlers import (
    ProtobufHandlers,
    RateLimitedLog,
    StreamContext,
    limit_messages,
    serve_stream,
)

NAME = "TransformerConnectionHandler.rpc_inference"


class Writer:
    """What the handler writes back, as bytes."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def messages(self) -> list[runtime_pb2.ExpertResponse | RPCError]:
        out, data = [], bytes(self.data)
        while data:
            length = int.from_bytes(data[1 : 1 + P2P.HEADER_LEN], P2P.BYTEORDER)
            body = data[1 + P2P.HEADER_LEN : 1 + P2P.HEADER_LEN + length]
            kind = RPCError if data[:1] == P2P.ERROR_MARKER else runtime_pb2.ExpertResponse
            out.append(kind.FromString(body))
            data = data[1 + P2P.HEADER_LEN + length :]
        return out


def frame(message, length: int | None = None) -> bytes:
    body = message.SerializeToString()
    size = len(body) if length is None else length
    return P2P.MESSAGE_MARKER + size.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


def request(num_bytes: int) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(uid="x", tensors=[runtime_pb2.Tensor(buffer=bytes(num_bytes))])


async def serve(handler, *chunks: bytes, cap: int, eof: bool = True) -> tuple[Writer, StreamContext]:
    reader = asyncio.StreamReader()
    for chunk in chunks:
        reader.feed_data(chunk)
    if eof:
        reader.feed_eof()
    writer = Writer()
    context = StreamContext(NAME, "server", "peer-abcdef", cap)
    await asyncio.wait_for(serve_stream(handler, runtime_pb2.ExpertRequest, context, reader, writer), 10)
    assert writer.closed
    return writer, context


def echo(seen: list, lower_to: int | None = None):
    async def handler(requests, context):
        async for message in requests:
            seen.append(message)
            if lower_to is not None:
                limit_messages(context, lower_to)
            yield runtime_pb2.ExpertResponse(metadata=message.uid.encode())

    return handler


async def test_an_oversized_message_is_refused_from_its_header_before_its_body_arrives():
    seen: list = []
    announced = 64 * 2**20  # only its header and 1 KB of it are ever sent: the body never comes
    head = frame(request(1024), length=announced)[: 1 + P2P.HEADER_LEN + 1024]
    writer, _ = await serve(echo(seen), head, cap=2**20, eof=False)
    (error,) = writer.messages()
    assert isinstance(error, RPCError)
    assert f"a message of {announced} bytes exceeds this stream's limit of {2**20} bytes" in error.message
    assert seen == []


async def test_messages_within_the_cap_pass_and_a_cap_lowered_by_the_handler_holds():
    seen: list = []
    chunks = [frame(request(50)), frame(request(60)), frame(request(500)), frame(request(10))]
    writer, context = await serve(echo(seen, lower_to=200), *chunks, cap=2**20)
    *replies, error = writer.messages()
    assert [r.metadata for r in replies] == [b"x", b"x"] and len(seen) == 2
    assert context.max_message_bytes == 200
    assert "exceeds this stream's limit of 200 bytes" in error.message


async def test_the_callers_end_of_stream_ends_the_handlers_input():
    seen: list = []
    end = P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
    writer, _ = await serve(echo(seen), frame(request(10)), end, cap=2**20, eof=False)
    assert len(writer.messages()) == 1 and len(seen) == 1


async def test_a_garbled_message_is_refused_with_the_reason():
    writer, _ = await serve(echo([]), P2P.MESSAGE_MARKER + (3).to_bytes(8, "big") + b"\xff\xff\xff", cap=100)
    assert "rpc_inference: a message is not a valid ExpertRequest" in writer.messages()[0].message


async def test_refusals_are_one_line_each_and_a_flood_of_them_is_cut(monkeypatch, caplog):
    now = [0.0]
    monkeypatch.setattr(
        stream_handlers, "refusals", RateLimitedLog(stream_handlers.logger, 60, 3, lambda: now[0])
    )

    async def refusing(requests, context):
        async for _ in requests:
            raise WireError("InvalidRequest: tree: must hold one parent per token\nsecond line")
        yield runtime_pb2.ExpertResponse()

    caplog.set_level(logging.DEBUG)
    for _ in range(10):
        writer, _ = await serve(refusing, frame(request(10)), cap=100)
        assert (
            "InvalidRequest: tree: must hold one parent per token\nsecond line"
            in writer.messages()[0].message
        )
    now[0] = 61.0
    await serve(refusing, frame(request(10)), cap=100)
    lines = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert [r.name for r in lines] == ["corolla.swarm.p2p.stream_handlers"] * 4
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in lines)
    assert lines[0].getMessage() == (
        "Refused rpc_inference from ...abcdef: InvalidRequest: tree: must hold one parent per token"
    )
    assert lines[-1].getMessage().endswith("(7 similar lines left out)")


@pytest.mark.parametrize("handler_error", [InvalidRequest("bad"), RuntimeError("bug")])
async def test_a_failing_handler_never_logs_a_traceback(caplog, handler_error):
    async def failing(requests, context):
        raise handler_error
        yield

    caplog.set_level(logging.DEBUG)
    writer, _ = await serve(failing, cap=100, eof=False)
    assert str(handler_error) in writer.messages()[0].message
    assert all(r.exc_info is None for r in caplog.records)


async def test_a_stream_cancelled_by_the_servers_stop_ends_quietly(caplog):
    """p2pd's client runs each stream in a task nobody awaits; asyncio's stream callback logs a cancelled
    one as an ERROR with a traceback (two of them after "Server stopped", issue 26)."""
    registered = {}

    class FakeP2P:
        peer_id = "server"

        async def add_binary_stream_handler(self, name, handle):
            registered[name] = handle

    async def waiting(requests, context):
        async for _ in requests:
            yield runtime_pb2.ExpertResponse()

    await ProtobufHandlers(FakeP2P()).add_stream_handler(NAME, waiting, runtime_pb2.ExpertRequest, 100)
    info = type("StreamInfo", (), {"peer_id": "peer-abcdef"})()
    task = asyncio.create_task(registered[NAME](info, asyncio.StreamReader(), Writer()))
    await asyncio.sleep(0.1)
    task.cancel()
    await asyncio.wait({task})
    assert not task.cancelled() and task.exception() is None


async def test_a_message_sent_right_behind_the_first_is_held_to_the_cap_the_first_one_set():
    """A session's cap comes from its first message: the second, already in the stream behind it, must
    not be read ahead under the server-wide cap (a 64 MB step of a max_length=16 session got through)."""
    seen: list = []

    async def session(requests, context):
        async for message in requests:
            seen.append(message)
            await asyncio.sleep(0.05)  # the handler checks the first message (the server awaits, too)
            limit_messages(context, 200)
            yield runtime_pb2.ExpertResponse()

    writer, _ = await serve(session, frame(request(10)), frame(request(500)), cap=2**20)
    reply, error = writer.messages()
    assert len(seen) == 1 and "exceeds this stream's limit of 200 bytes" in error.message


async def test_input_arriving_after_a_handlers_error_is_read_before_the_stream_closes():
    """A caller's end of stream (hivemind writes it right behind the request) may arrive after the handler
    refused the request: closing with it unread resets the stream, and the reset can overtake the error
    (the caller saw BrokenPipeError instead of the refusal, in CI)."""

    async def refusing(requests, context):
        async for _ in requests:
            raise InvalidRequest("unknown block")
        yield runtime_pb2.ExpertResponse()

    reader, writer = asyncio.StreamReader(), Writer()
    reader.feed_data(frame(request(10)))

    async def caller_ends_late() -> None:
        await asyncio.sleep(0.05)
        reader.feed_data(P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        reader.feed_eof()

    late = asyncio.create_task(caller_ends_late())
    context = StreamContext(NAME, "server", "peer-abcdef", 100)
    await asyncio.wait_for(serve_stream(refusing, runtime_pb2.ExpertRequest, context, reader, writer), 10)
    await late
    assert "unknown block" in writer.messages()[0].message
    assert writer.closed and reader.at_eof()  # nothing was left unread when it closed
