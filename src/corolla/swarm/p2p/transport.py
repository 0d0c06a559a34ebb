"""How a peer reaches another: opening a protobuf stream, or one request and its reply (`Transport`).

`P2PTransport` does it over hivemind's libp2p daemon, through a server's relays when its record says
it is behind NAT (swarm/nat/circuit_book.py); it is the only one outside tests, where an in-process transport
stands in for the network (tests/loopback.py) so that everything above it, client and server, runs
unchanged without sockets. `remote_errors` turns what a failed call raises
into corolla's typed errors, whichever transport raised it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Protocol, TypeVar

from google.protobuf.message import Message
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError, P2PHandlerError

from corolla.errors import ConnectionLost, InvalidRequest, ServerUnavailable, decode_remote_error
from corolla.swarm.nat.circuit_book import BOOK, CircuitBook
from corolla.swarm.p2p.p2p_io import Stream

M = TypeVar("M", bound=Message)


class MessageStream(Protocol):
    """One open stream of protobuf messages to a peer's stream handler (swarm/p2p/p2p_io.py `Stream`)."""

    async def send(self, message: Message) -> None: ...

    async def receive(self, message_type: type[M]) -> M | None: ...

    async def end(self) -> None: ...

    def close(self) -> None: ...


class Transport(Protocol):
    async def open_stream(self, peer_id: str, rpc: str) -> MessageStream: ...

    async def call(self, peer_id: str, rpc: str, request: Message, response_type: type[M]) -> M: ...

    async def limit_ahead(self, peer_id: str, nbytes: int) -> str | None:
        """Why the path to `peer_id` should be made anew before `nbytes` more go to it (a relay's limit
        is near), or None."""
        ...


class P2PTransport:
    """The libp2p network, through a hivemind P2P handle (a DHT's replica)."""

    def __init__(self, p2p: P2P, book: CircuitBook = BOOK):
        self.p2p = p2p
        self.book = book

    async def open_stream(self, peer_id: str, rpc: str) -> MessageStream:
        await self.book.reach(self.p2p, peer_id)
        meter = partial(self.book.count, peer_id) if self.book.paths(peer_id) else None  # relayed only
        return await Stream.open(self.p2p, PeerID.from_base58(peer_id), rpc, meter)

    async def call(self, peer_id: str, rpc: str, request: Message, response_type: type[M]) -> M:
        await self.book.reach(self.p2p, peer_id)
        return await self.p2p.call_protobuf_handler(PeerID.from_base58(peer_id), rpc, request, response_type)

    async def limit_ahead(self, peer_id: str, nbytes: int) -> str | None:
        return await self.book.limit_ahead(self.p2p, peer_id, nbytes)


@asynccontextmanager
async def remote_errors(peer_id: str, timeout: float) -> AsyncIterator[None]:
    """Turn what a failed call to a server raises into corolla's typed errors.

    A server's InvalidRequest becomes ServerUnavailable: the client checked what it sent, so a server
    that refuses a well-formed request is at fault (it is then banned and replaced like a dead one).
    """
    short = peer_id[-6:]
    try:
        yield
    except P2PHandlerError as e:
        error = decode_remote_error(str(e))
        if isinstance(error, InvalidRequest):
            raise ServerUnavailable(
                f"server ...{short} refused a well-formed request: {error.message}"
            ) from None
        raise decode_remote_error(str(e), f"...{short}") from None
    except (asyncio.TimeoutError, TimeoutError):
        raise ServerUnavailable(f"server ...{short} did not reply within {timeout:.1f}s") from None
    except (P2PDaemonError, ConnectionError, OSError, asyncio.IncompleteReadError, StopAsyncIteration) as e:
        BOOK.lost(peer_id)
        raise ConnectionLost(
            f"server ...{short} is unreachable or closed the stream ({type(e).__name__}: {e})"
        ) from None
