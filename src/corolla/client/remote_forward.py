"""A forward pass through one server's blocks: `rpc_forward`, or `rpc_forward_stream` for big payloads.

Unary messages are capped at 4 MiB by the libp2p daemon, so larger requests go over a stream in chunks.
The stream's sender keeps its side open until the whole reply has arrived (otherwise the daemon may cut
the reply's tail), and the reply's chunk count is checked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from corolla.client.swarm import peer, remote_errors
from corolla.errors import ServerUnavailable
from corolla.swarm.routing import Hop
from corolla.wire import tensors as wire_tensors
from corolla.wire.messages import RPC_FORWARD, RPC_FORWARD_STREAM, ForwardRequest
from corolla.wire.records import block_uids

UNARY_LIMIT_BYTES = 3 * 2**20  # under the daemon's 4 MiB cap, with room for metadata and framing


async def remote_forward(
    p2p: P2P,
    hop: Hop,
    dht_prefix: str,
    hidden: torch.Tensor,
    timeout: float,
    prompts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run blocks [hop.start, hop.end) on hop.peer_id over hidden states [B, T, H]."""
    tensors = [
        wire_tensors.serialize(hidden),
        wire_tensors.serialize(prompts) if prompts is not None else wire_tensors.empty(),
    ]
    request = runtime_pb2.ExpertRequest(
        uid=block_uids(dht_prefix, hop.start, hop.end), tensors=tensors, metadata=ForwardRequest().to_bytes()
    )
    async with remote_errors(hop.peer_id, timeout):
        if request.ByteSize() <= UNARY_LIMIT_BYTES:
            response = await asyncio.wait_for(
                p2p.call_protobuf_handler(
                    peer(hop.peer_id), RPC_FORWARD, request, runtime_pb2.ExpertResponse
                ),
                timeout,
            )
            reply = list(response.tensors)
        else:
            reply = await asyncio.wait_for(_forward_stream(p2p, hop.peer_id, request), timeout)
    outputs = wire_tensors.deserialize(reply[0], "outputs") if reply else None
    if outputs is None or outputs.shape != hidden.shape:
        raise ServerUnavailable(f"server ...{hop.peer_id[-6:]} returned a malformed forward reply")
    return outputs


async def _forward_stream(
    p2p: P2P, peer_id: str, request: runtime_pb2.ExpertRequest
) -> list[runtime_pb2.Tensor]:
    received_all = asyncio.Event()

    async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        for i, chunk in enumerate(wire_tensors.split_tensors(request.tensors)):
            yield runtime_pb2.ExpertRequest(
                uid=request.uid if i == 0 else "",
                tensors=[chunk],
                metadata=request.metadata if i == 0 else b"",
            )
        await received_all.wait()  # keep our side open until the whole reply is here

    parts: list[runtime_pb2.Tensor] = []
    stream = await p2p.iterate_protobuf_handler(
        peer(peer_id), RPC_FORWARD_STREAM, requests(), runtime_pb2.ExpertResponse
    )
    try:
        async for response in stream:
            parts.extend(response.tensors)
            if wire_tensors.count_expected_chunks(parts, 1) == len(parts):
                received_all.set()  # then the server sees our end of stream and finishes its side
    finally:
        received_all.set()
    if wire_tensors.count_expected_chunks(parts, 1) != len(parts):
        raise ServerUnavailable(f"server ...{peer_id[-6:]} sent an incomplete reply ({len(parts)} chunks)")
    return wire_tensors.combine_tensors(parts, ("outputs",))
