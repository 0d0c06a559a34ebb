"""Errors that corolla raises, and how they cross the wire.

Every error a peer or a user can cause is a `CorollaError` subclass whose message names the field and the
limit involved. `str(e)` is the message alone (a traceback already names the class); `repr(e)` and
`wire_text(e)` are "ClassName: message", the text that crosses the wire: hivemind sends a failed unary
handler's `repr(e)`, and the stream handlers raise `WireError(wire_text(e))`. The client turns that text
back into the same class with `decode_remote_error`. Nothing here imports torch or hivemind.
"""

from __future__ import annotations

import re


class CorollaError(Exception):
    """Base class of every error corolla raises on purpose."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return wire_text(self)


def wire_text(error: CorollaError) -> str:
    """The text an error travels as to the peer that caused it: "ClassName: message"."""
    return f"{type(error).__name__}: {error.message}"


class WireError(Exception):
    """What a stream handler raises for a CorollaError: its str() is the wire text."""


class InvalidRequest(CorollaError):
    """A request (from a peer, a user or a CLI) is malformed or exceeds a limit."""


class LengthLimit(InvalidRequest):
    """A session would be longer than the servers of some blocks keep: `limit` tokens at most."""

    def __init__(self, message: str, limit: int):
        super().__init__(message)
        self.limit = limit


class SessionNotFound(CorollaError):
    """A message refers to an inference session that does not exist (any more) on this server."""


class CacheExhausted(CorollaError):
    """The server could not reserve attention cache for a session within its alloc_timeout."""


class SessionTimeout(CorollaError):
    """An inference session waited too long for its next step, or lived past its time limit."""


class ServerUnavailable(CorollaError):
    """A server is shutting down, unreachable, or failed while serving a request."""


class ConnectionLost(ServerUnavailable):
    """The connection to a server broke or could not be made: the server is gone, or the path to it (a
    relay ends the connections it relays at its limits)."""


class MissingBlocks(CorollaError):
    """No server in the swarm currently covers some of the model's blocks."""

    def __init__(self, message: str, blocks: tuple[int, ...] = ()):
        super().__init__(message)
        self.blocks = blocks


class UnsupportedModel(CorollaError):
    """A checkpoint uses an architecture or option corolla does not implement."""


class StartFailed(CorollaError):
    """This peer could not start: its listen address or port, or none of its initial peers answered."""


class NotAllowed(CorollaError):
    """A private swarm's server refused a peer that is not on its list of allowed peers."""


class RemoteError(CorollaError):
    """A server failed with an error that is not one of corolla's own types."""


# errors after which another server may succeed (the client bans this one and replaces it); an
# InvalidRequest or MissingBlocks the client raises itself is final
RETRYABLE = (ServerUnavailable, SessionTimeout, CacheExhausted, RemoteError)

_WIRE_ERRORS: dict[str, type[CorollaError]] = {
    cls.__name__: cls
    for cls in (
        InvalidRequest,
        SessionNotFound,
        CacheExhausted,
        SessionTimeout,
        ServerUnavailable,
        NotAllowed,
    )
}
_WIRE_ERRORS["ConnectionLost"] = ServerUnavailable  # a server's own lost connection: it failed to serve
_WIRE_PATTERN = re.compile(r"\b(" + "|".join(_WIRE_ERRORS) + r"): (.*)", re.DOTALL)


def counted(count: int, noun: str) -> str:
    """ "1 server", "2 servers": a count with its noun in the right number (nouns taking an -s)."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def decode_remote_error(text: str, peer: str = "") -> CorollaError:
    """Rebuild a typed error from the text of a hivemind P2PHandlerError."""
    origin = f" (from server {peer})" if peer else ""
    match = _WIRE_PATTERN.search(text)
    if match is None:
        return RemoteError(f"{text}{origin}")
    cls = _WIRE_ERRORS[match.group(1)]
    message = match.group(2)
    return cls(f"{message.rstrip()}{origin}")
