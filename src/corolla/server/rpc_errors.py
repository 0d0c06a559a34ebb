"""How a request's error reaches its caller (server/handler.py): typed, and never as a raw traceback.

A `CorollaError` a request causes goes to the caller as it is; any other error is unexpected: its
traceback stays in this server's log and the caller gets a `ServerUnavailable`. hivemind sends a unary
handler's error as repr(error) and a stream's as str(error), so a stream's error travels as a
`WireError` whose text keeps the class (errors.wire_text).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from corolla.errors import CorollaError, ServerUnavailable, WireError, wire_text

logger = logging.getLogger(__name__)

ERROR_DRAIN_SECONDS = 0.5
Unary = Callable[..., Awaitable[Any]]


def internal_error(rpc: str, error: Exception) -> ServerUnavailable:
    """An unexpected error: its traceback stays in this server's log, the caller gets a typed error."""
    logger.error("%s failed unexpectedly", rpc, exc_info=error)
    return ServerUnavailable(f"{rpc}: internal error on this server ({type(error).__name__})")


def typed_errors(handler: Unary) -> Unary:
    """A unary handler (a method) whose unexpected errors reach the caller typed."""

    @functools.wraps(handler)
    async def typed(self: Any, request: Any, context: P2PContext) -> Any:
        try:
            return await handler(self, request, context)
        except CorollaError:
            raise
        except Exception as e:
            raise internal_error(handler.__name__, e) from e

    return typed


@contextlib.asynccontextmanager
async def reading_to_the_end(
    requests: AsyncIterator[runtime_pb2.ExpertRequest], rpc: str
) -> AsyncIterator[None]:
    """On an error, read what the caller already sent before the error reply goes out; the error is typed.

    hivemind closes the stream right after sending an error; closing it with unread incoming data resets
    the connection, and the reset can overtake the error message. Draining first (briefly: a caller that
    waits for our reply sends nothing more) lets the caller read a precise error instead of a broken pipe.
    """
    try:
        yield
    except Exception as e:
        error = e if isinstance(e, CorollaError) else internal_error(rpc, e)
        deadline = asyncio.get_running_loop().time() + ERROR_DRAIN_SECONDS
        with contextlib.suppress(Exception):
            while (left := deadline - asyncio.get_running_loop().time()) > 0:
                await asyncio.wait_for(anext(requests), left)
        raise WireError(wire_text(error)) from e
