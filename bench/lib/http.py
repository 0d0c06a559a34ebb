"""Raw HTTP on asyncio for the API benches: the measuring side stays light (no client library between the
clock and the socket)."""

from __future__ import annotations

import asyncio

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def open_stream(port: int, route: str, body: bytes) -> Connection:
    """POST `body` (JSON) to 127.0.0.1:`port` and read the status line: the connection, at the headers.
    A refused request raises, saying why (its stream would have no tokens)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"{status.decode().strip()}: {(await reader.read()).decode()[-500:]}")
    return reader, writer
