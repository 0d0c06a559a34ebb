"""Protobuf streams over hivemind's daemon: one write per message, and a stream whose end is seen at once.

hivemind's `P2P.send_protobuf` writes a message as three separate writes (type marker, length header,
body), and the daemon may relay each as its own frame: three system calls and wake-ups on each side for
every decode step. `install()` replaces it with one that sends the same bytes in a single write; the
wire format does not change, so unpatched peers read it as before.

hivemind's `iterate_protobuf_handler` writes the caller's requests from a task of its own and, when the
stream ends, waits for that task, which waits for the caller's next request. A peer that dies while a
reply is pending (a server killed mid-step) then looks alive until the caller's timeout. `Stream` is
written and read by its owner instead, on the same wire format: the end of the stream ends a read at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from google.protobuf.message import DecodeError, Message
from hivemind.p2p import P2P, P2PHandlerError, PeerID
from hivemind.proto.p2pd_pb2 import RPCError

M = TypeVar("M", bound=Message)
_installed = False


async def _send_protobuf(protobuf, writer: asyncio.StreamWriter) -> None:
    marker = P2P.ERROR_MARKER if isinstance(protobuf, RPCError) else P2P.MESSAGE_MARKER
    body = protobuf.SerializeToString()
    writer.write(marker + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body)
    await writer.drain()


def install() -> None:
    """Idempotent; called by everything in corolla that opens hivemind streams."""
    global _installed
    if not _installed:
        P2P.send_protobuf = staticmethod(_send_protobuf)
        _installed = True


class Stream:
    """One open stream to a peer's protobuf stream handler (e.g. a server's `rpc_inference`)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        name: str,
        meter: Callable[[int, int], None] | None = None,
    ):
        self._reader = reader
        self._writer = writer
        self._name = name
        self._meter = meter  # told the bytes of each message: (sent, received)

    @classmethod
    async def open(
        cls, p2p: P2P, peer_id: PeerID, handler: str, meter: Callable[[int, int], None] | None = None
    ) -> Stream:
        _, reader, writer = await p2p.call_binary_stream_handler(peer_id, handler)
        return cls(reader, writer, f"`{handler}` at {peer_id}", meter)

    async def send(self, message: Message) -> None:
        if self._meter is not None:
            self._meter(message.ByteSize(), 0)
        await P2P.send_protobuf(message, self._writer)

    async def receive(self, message_type: type[M]) -> M | None:
        """The next message, or None where the stream has ended (the peer finished, closed or died).

        An error the handler sent raises P2PHandlerError (as hivemind's calls do); bytes that are not a
        message raise ConnectionError. A read cancelled midway leaves the stream unreadable: close it.
        """
        try:
            message, error = await P2P.receive_protobuf(message_type, self._reader)
        except asyncio.IncompleteReadError:
            return None
        except (DecodeError, TypeError) as e:
            raise ConnectionError(f"malformed message on {self._name}: {e}") from None
        if error is not None:
            raise P2PHandlerError(f"Failed to call handler {self._name}: {error.message}")
        if self._meter is not None:
            self._meter(0, message.ByteSize())
        return message

    async def end(self) -> None:
        """No more requests: the handler finishes its replies, then ends the stream."""
        await P2P.send_protobuf(P2P.END_OF_STREAM, self._writer)

    def close(self) -> None:
        self._writer.close()
