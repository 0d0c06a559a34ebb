"""One write per protobuf message on hivemind's daemon streams.

hivemind's `P2P.send_protobuf` writes a message as three separate writes (type marker, length header,
body), and the daemon may relay each as its own frame: three system calls and wake-ups on each side for
every decode step. `install()` replaces it with one that sends the same bytes in a single write; the
wire format does not change, so unpatched peers read it as before.
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P
from hivemind.proto.p2pd_pb2 import RPCError

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
