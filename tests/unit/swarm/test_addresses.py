"""Swarm addresses checked before the libp2p daemon starts, and its failures told in one line."""

from __future__ import annotations

import socket

import pytest

from corolla.errors import StartFailed
from corolla.swarm.p2p.addresses import check_listen_port, explain_start_failure, parse_peer, peer_args

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmXfmJmpNSm5pjFXvEMcXxf2NAzAvmbeWRbxeAjJwHiFHf"


def test_a_peer_is_a_multiaddress_with_its_peer_id():
    assert parse_peer(PEER) == PEER
    with pytest.raises(ValueError, match="'foo' is not a multiaddress"):
        parse_peer("foo")
    with pytest.raises(ValueError, match="has no /p2p/PEER_ID part"):
        parse_peer("/ip4/127.0.0.1/tcp/31337")
    with pytest.raises(ValueError, match="is not a multiaddress"):
        parse_peer("/ip4/127.0.0.1/tcp/99999/p2p/QmXfmJmpNSm5pjFXvEMcXxf2NAzAvmbeWRbxeAjJwHiFHf")
    assert peer_args([PEER, PEER]) == ["--initial-peers", PEER, "--initial-peers", PEER]


@pytest.mark.parametrize("reuse_port", [False, True])
def test_a_port_another_socket_listens_on_is_refused(reuse_port):
    with socket.socket() as other:
        if reuse_port:  # as the libp2p daemon listens: a second daemon would share the port silently
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(StartFailed, match=f"swarm port {port} on 127.0.0.1 is in use by another process"):
            check_listen_port("127.0.0.1", port)
        with pytest.raises(StartFailed, match="is in use"):
            check_listen_port("0.0.0.0", port)
    check_listen_port("127.0.0.1", port)  # free again
    check_listen_port("127.0.0.1", 0)


def test_hosts_that_are_no_address_here_are_refused():
    with pytest.raises(StartFailed, match="--host 'localhost' is not an IP address"):
        check_listen_port("localhost", 0)
    with pytest.raises(StartFailed, match="--host 192.0.2.1 is not an address of this machine"):
        check_listen_port("192.0.2.1", 31337)


def test_daemon_failures_become_one_line_with_the_fix():
    unreachable = explain_start_failure(
        RuntimeError("Daemon failed to start: 2026/12/01 14:23:13 failed to connect to bootstrap peers"),
        "127.0.0.1",
        0,
        [PEER],
    )
    assert str(unreachable).startswith(f"no --initial-peers answered ({PEER})")
    in_use = explain_start_failure(
        RuntimeError(
            "failed to listen on any addresses: [listen tcp4 0.0.0.0:31337: bind: address already in use]"
        ),
        "0.0.0.0",
        31337,
        [],
    )
    assert "swarm port 31337 on 0.0.0.0 is in use" in str(in_use) and "--port" in str(in_use)
    other = explain_start_failure(RuntimeError("line 1\nsomething odd"), "0.0.0.0", 0, [])
    assert str(other) == "the libp2p daemon did not start: something odd" and "\n" not in str(other)
