"""What a user types to reach the swarm (multiaddresses, a host and a port), checked before the libp2p
daemon starts, and its failures to start told in one line.

The daemon reports a bad address, a port in use or an unreachable bootstrap peer as a `P2PDaemonError`
with its own log line inside; `explain_start_failure` turns those into a `StartFailed` naming the
option and the fix. The daemon listens with SO_REUSEPORT, so a second peer on a port another process
already listens on would start without error and the kernel would split connections between the two:
`check_listen_port` binds the port once without that option first, which fails if anyone listens there.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Iterable, Sequence

from corolla.errors import StartFailed

EXAMPLE = "/ip4/HOST/tcp/PORT/p2p/PEER_ID, as `corolla dht` prints it"


def parse_peer(text: str) -> str:
    """One --initial-peers value: a multiaddress that ends with the peer's id. Raises ValueError."""
    from hivemind.utils.multiaddr import Multiaddr  # here: `corolla --help` need not import hivemind

    try:
        protocols = [protocol.name for protocol in Multiaddr(text).protocols()]
    except ValueError as e:
        raise ValueError(f"{text!r} is not a multiaddress ({e}); expected {EXAMPLE}") from None
    if "p2p" not in protocols:
        raise ValueError(f"{text!r} has no /p2p/PEER_ID part; expected {EXAMPLE}")
    return text


def peer_args(peers: Iterable[str]) -> list[str]:
    """Command-line arguments naming `peers` (one --initial-peers per address)."""
    return [arg for peer in peers for arg in ("--initial-peers", peer)]


def check_listen_port(host: str, port: int) -> None:
    """Raise StartFailed unless this process could listen on host:port alone (port 0: any free port)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        raise StartFailed(f"--host {host!r} is not an IP address (e.g. 0.0.0.0 or 127.0.0.1)") from None
    if port != 0 and (code := listen_error(host, port, family)) is not None:
        raise _listen_error(host, port, code)


def listen_error(host: str, port: int, family: int = 0) -> int | None:
    """The errno with which listening alone on host:port fails now (None: it would not). Raises
    socket.gaierror for a host name that does not resolve."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        # SO_REUSEADDR ignores connections in TIME_WAIT (a restart), never a socket that listens
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
            probe.listen(1)
        except OSError as e:
            return e.errno
    return None


def _listen_error(host: str, port: int, code: int | None) -> StartFailed:
    if code == errno.EADDRINUSE:
        return StartFailed(
            f"swarm port {port} on {host} is in use by another process: stop that process, or pass "
            "another port (--port; --p2p-port for `corolla api`) or 0 for any free port"
        )
    if code == errno.EADDRNOTAVAIL:
        return StartFailed(f"--host {host} is not an address of this machine; pass one of its own or 0.0.0.0")
    if code == errno.EACCES:
        return StartFailed(f"swarm port {port} needs privileges on this machine; pass a port above 1023")
    return StartFailed(f"cannot listen on {host}:{port} ({errno.errorcode.get(code or 0, code)})")


def explain_start_failure(error: Exception, host: str, port: int, peers: Sequence[str]) -> StartFailed:
    """The one-line reason a peer's libp2p daemon did not start (a P2PDaemonError's text)."""
    text = str(error)
    if "failed to connect to bootstrap peers" in text:
        return StartFailed(
            f"no --initial-peers answered ({', '.join(peers)}): check that the peer runs and that the "
            "address is the one it printed (host, port and peer id)"
        )
    if "address already in use" in text:
        return _listen_error(host, port, errno.EADDRINUSE)
    if "assign requested address" in text:
        return _listen_error(host, port, errno.EADDRNOTAVAIL)
    if "multiaddr" in text:
        return StartFailed(f"an address is not valid: {_last_line(text)}; --initial-peers expects {EXAMPLE}")
    return StartFailed(f"the libp2p daemon did not start: {_last_line(text)}")


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else "no reason given"
