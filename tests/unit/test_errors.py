"""CorollaError text: the message alone in str() and tracebacks, "ClassName: message" on the wire."""

from __future__ import annotations

import traceback

from corolla.errors import (
    ConnectionLost,
    InvalidRequest,
    RemoteError,
    ServerUnavailable,
    SessionNotFound,
    WireError,
    counted,
    decode_remote_error,
    wire_text,
)


def test_tracebacks_name_the_class_once():
    try:
        raise InvalidRequest("field 'x' must be positive")
    except InvalidRequest as e:
        last = traceback.format_exc().strip().splitlines()[-1]
        assert str(e) == "field 'x' must be positive"
    assert last == "corolla.errors.InvalidRequest: field 'x' must be positive"


def test_wire_text_round_trips_to_the_same_class():
    error = SessionNotFound("session 'a' is closed")
    assert repr(error) == wire_text(error) == "SessionNotFound: session 'a' is closed"
    for text in (str(WireError(wire_text(error))), f"Failed to call handler `rpc_forward`: {error!r}"):
        decoded = decode_remote_error(text, "...abc")
        assert isinstance(decoded, SessionNotFound)
        assert str(decoded) == "session 'a' is closed (from server ...abc)"
    assert isinstance(decode_remote_error("boom"), RemoteError)


def test_a_servers_own_lost_connection_reaches_the_client_as_its_failure():
    """Not as a lost connection to that server, which the client may excuse (a relay's cut)."""
    decoded = decode_remote_error(wire_text(ConnectionLost("the next server closed the stream")))
    assert type(decoded) is ServerUnavailable


def test_counts_take_the_right_number():
    assert counted(1, "server") == "1 server"
    assert counted(0, "usable server") == "0 usable servers"
    assert counted(2, "server") == "2 servers"
