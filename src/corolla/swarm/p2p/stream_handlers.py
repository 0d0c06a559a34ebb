"""A server's protobuf stream handlers on hivemind's daemon, with each message's length capped before its
body is read, and a refused request logged as one rate-limited line.

hivemind's `P2P.add_protobuf_handler` reads every message of a stream whole, whatever length its header
announces (a peer could make a server buffer gigabytes for one step), and logs each error a handler ends
with as a WARNING with its traceback (a peer could flood the log with bad requests). `ProtobufHandlers`
serves the same wire format (a marker byte, an 8-byte length, the body; an RPCError ends the stream), so
hivemind's callers and corolla's `Stream` read it unchanged, with both bounded: a message longer than its
stream's cap is refused from its header, and a handler's error reaches the caller as before and the log
as one line. A handler may lower its stream's cap once it knows more (`limit_messages`: a session's own
max_length and batch, after its first message).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError, Message
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto.p2pd_pb2 import RPCError

from corolla.errors import InvalidRequest
from corolla.swarm.p2p import p2p_io

logger = logging.getLogger(__name__)

DRAIN_SECONDS = 0.5  # input read (and dropped) after an error reply: closing with unread input resets it
StreamHandler = Callable[[AsyncIterator[Any], "StreamContext"], AsyncIterator[Message]]


@dataclass
class StreamContext:
    """hivemind's P2PContext of one stream, and the cap on its messages' length (its handler may lower it)."""

    handle_name: str
    local_id: PeerID
    remote_id: PeerID
    max_message_bytes: int


def limit_messages(context: Any, max_bytes: int) -> None:
    """Lower the cap on the length of the stream's next messages (it never rises)."""
    context.max_message_bytes = min(context.max_message_bytes, max_bytes)


class RateLimitedLog:
    """At most `burst` lines per `period` seconds; the lines left out are counted in the next one."""

    def __init__(self, log: logging.Logger, period: float = 60.0, burst: int = 10, clock=time.monotonic):
        self.log = log
        self.period = period
        self.burst = burst
        self.clock = clock
        self.window_start = -float("inf")
        self.num_lines = 0
        self.num_left_out = 0

    def __call__(self, level: int, message: str, *args: object) -> None:
        now = self.clock()
        if now - self.window_start >= self.period:
            self.window_start = now
            self.num_lines = 0
        if self.num_lines >= self.burst:
            self.num_left_out += 1
            return
        self.num_lines += 1
        if self.num_left_out:
            message += " (%d similar lines left out)"
            args = (*args, self.num_left_out)
            self.num_left_out = 0
        self.log.log(level, message, *args)


refusals = RateLimitedLog(logger)


class ProtobufHandlers:
    """Registers a server's handlers on its P2P: streams through `serve_stream`, unary calls as hivemind's
    (the daemon caps those at 4 MiB)."""

    def __init__(self, p2p: P2P):
        self.p2p = p2p
        p2p_io.install()

    async def add_unary_handler(self, name: str, handler: Callable[..., Awaitable], input_type: type) -> None:
        await self.p2p.add_protobuf_handler(name, handler, input_type)

    async def add_stream_handler(
        self, name: str, handler: StreamHandler, input_type: type[Message], max_message_bytes: int
    ) -> None:
        async def handle(
            info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            context = StreamContext(name, self.p2p.peer_id, info.peer_id, max_message_bytes)
            try:
                await serve_stream(handler, input_type, context, reader, writer)
            except asyncio.CancelledError:
                # the server is stopping: nothing awaits this connection's task, and asyncio's stream
                # callback would log a cancelled one as an ERROR with a traceback (Python 3.11)
                return

        await self.p2p.add_binary_stream_handler(name, handle)


async def serve_stream(
    handler: StreamHandler,
    input_type: type[Message],
    context: StreamContext,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    """Feed the stream's messages to `handler` and write its replies, until either side ends.

    A message's header is read ahead (so a caller that goes away is noticed), its body only once the
    handler asks for it: the cap it is checked against then holds whatever the handler learnt from the
    messages before it (hivemind reads 5 messages ahead)."""
    requests: asyncio.Queue = asyncio.Queue()
    wanted = asyncio.Event()  # the handler waits for its next message

    async def incoming() -> AsyncIterator[Message]:
        while True:
            wanted.set()
            item = await requests.get()
            if item is None:
                return
            if isinstance(item, InvalidRequest):
                raise item
            yield item

    with contextlib.closing(writer):
        processing = asyncio.create_task(_process(handler(incoming(), context), context, writer))
        try:
            while True:
                receiving = asyncio.create_task(_receive(input_type, reader, context, wanted))
                await asyncio.wait({processing, receiving}, return_when=asyncio.FIRST_COMPLETED)
                if processing.done():
                    receiving.cancel()
                    await asyncio.wait({receiving})  # one reader at a time
                    if processing.result():  # the handler's error is sent: let it arrive before the reset
                        await _drop_input(reader, processing)
                    return
                try:
                    request = receiving.result()
                except asyncio.IncompleteReadError:  # the caller closed the stream, or died
                    return
                except InvalidRequest as error:  # the rest of the stream is not read, only dropped
                    await requests.put(error)
                    await _drop_input(reader, processing)
                    return
                await requests.put(request)  # None: the caller's end of stream
        finally:
            processing.cancel()


async def _receive(
    input_type: type[Message], reader: asyncio.StreamReader, context: StreamContext, wanted: asyncio.Event
) -> Message | None:
    """The next message (None for the caller's end of stream), its length checked before its body is read,
    once the handler wants it."""
    marker = await reader.readexactly(1)
    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    await wanted.wait()
    wanted.clear()
    name = context.handle_name.rpartition(".")[2]
    if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
        raise InvalidRequest(f"{name}: a message starts with {marker!r}, not a message or error marker")
    if length > context.max_message_bytes:
        raise InvalidRequest(
            f"{name}: a message of {length} bytes exceeds this stream's limit of "
            f"{context.max_message_bytes} bytes (this server's limits, and its session's)"
        )
    body = await reader.readexactly(length)
    if marker == P2P.ERROR_MARKER:  # hivemind's END_OF_STREAM is an empty RPCError
        return None
    try:
        return input_type.FromString(body)
    except DecodeError as e:
        raise InvalidRequest(f"{name}: a message is not a valid {input_type.__name__} ({e})") from None


async def _process(
    replies: AsyncIterator[Message], context: StreamContext, writer: asyncio.StreamWriter
) -> bool:
    """Write the handler's replies; its error goes to the caller and, as one line at most, to the log.
    True when the handler ended with an error."""
    try:
        async for reply in replies:
            try:
                await P2P.send_protobuf(reply, writer)
            except Exception:  # the caller closed the stream or died: it knows why
                logger.debug("Could not send a reply on %s", context.handle_name, exc_info=True)
                return False
    except Exception as e:
        peer = str(context.remote_id)[-6:]
        text = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        rpc = context.handle_name.rpartition(".")[2]
        refusals(logging.INFO, "Refused %s from ...%s: %s", rpc, peer, text)
        with contextlib.suppress(Exception):  # the caller may be gone already
            await P2P.send_protobuf(RPCError(message=str(e)), writer)
        return True
    return False


async def _drop_input(reader: asyncio.StreamReader, processing: asyncio.Task) -> None:
    """Read and drop the caller's input until the handler has sent its error, then for DRAIN_SECONDS more
    (or until the caller's end): closing a stream with unread input resets it, and the reset can overtake
    the error."""

    async def drop() -> None:
        while await reader.read(2**16):
            pass

    dropping = asyncio.create_task(drop())
    try:
        await asyncio.wait({processing})  # the handler meets the error at its next read and sends it
        await asyncio.wait({dropping}, timeout=DRAIN_SECONDS)
    finally:
        dropping.cancel()
