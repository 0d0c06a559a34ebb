"""Cache-free passes through one server's blocks: forward (`rpc_forward`) and backward (`rpc_backward`),
or their `_stream` variants for big payloads.

Unary messages are capped at 4 MiB by the libp2p daemon, so larger requests go over a stream in chunks.
The stream's sender keeps its side open until the whole reply has arrived (otherwise the daemon may cut
the reply's tail), and the reply's chunk count is checked.
"""

from __future__ import annotations

import asyncio

import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from corolla.client.swarm import peer, remote_errors
from corolla.errors import ServerUnavailable
from corolla.swarm.p2p_io import Stream
from corolla.swarm.routing import Hop
from corolla.wire import tensors as wire_tensors
from corolla.wire.messages import (
    RPC_BACKWARD,
    RPC_BACKWARD_STREAM,
    RPC_FORWARD,
    RPC_FORWARD_STREAM,
    ForwardRequest,
)
from corolla.wire.records import block_uids

UNARY_LIMIT_BYTES = 3 * 2**20  # under the daemon's 4 MiB cap, with room for metadata and framing


async def remote_forward(
    p2p: P2P,
    hop: Hop,
    dht_prefix: str,
    hidden: torch.Tensor,
    timeout: float,
    prompts: torch.Tensor | None = None,
    adapter: str | None = None,
) -> torch.Tensor:
    """Run blocks [hop.start, hop.end) on hop.peer_id over hidden states [B, T, H]."""
    request = _request(hop, dht_prefix, [hidden, prompts], adapter)
    reply = await _call(p2p, hop.peer_id, (RPC_FORWARD, RPC_FORWARD_STREAM), request, ("outputs",), timeout)
    outputs = wire_tensors.deserialize(reply[0], "outputs") if reply else None
    if outputs is None or outputs.shape != hidden.shape:
        raise ServerUnavailable(f"server ...{hop.peer_id[-6:]} returned a malformed forward reply")
    return outputs


async def remote_backward(  # noqa: PLR0913
    p2p: P2P,
    hop: Hop,
    dht_prefix: str,
    inputs: torch.Tensor,
    grad_outputs: torch.Tensor,
    timeout: float,
    prompts: torch.Tensor | None = None,
    adapter: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients wrt the inputs [B, T, H] of blocks [hop.start, hop.end) and wrt their deep prompts
    (None without prompts), given the gradient of the outputs."""
    request = _request(hop, dht_prefix, [inputs, grad_outputs, prompts], adapter)
    names = ("grad_inputs", "grad_prompts")
    reply = await _call(p2p, hop.peer_id, (RPC_BACKWARD, RPC_BACKWARD_STREAM), request, names, timeout)
    grads = [wire_tensors.deserialize(proto, name) for proto, name in zip(reply, names, strict=False)]
    if len(grads) != 2 or grads[0].shape != inputs.shape:
        raise ServerUnavailable(f"server ...{hop.peer_id[-6:]} returned a malformed backward reply")
    if prompts is None:
        return grads[0], None
    if grads[1].shape[0] != prompts.shape[0] or grads[1].shape[2:] != prompts.shape[2:]:
        raise ServerUnavailable(f"server ...{hop.peer_id[-6:]} returned malformed prompt gradients")
    return grads[0], grads[1]


def _request(
    hop: Hop, dht_prefix: str, tensors: list[torch.Tensor | None], adapter: str | None
) -> runtime_pb2.ExpertRequest:
    """A forward/backward request for the hop's blocks; an absent tensor (None) is sent empty."""
    return runtime_pb2.ExpertRequest(
        uid=block_uids(dht_prefix, hop.start, hop.end),
        tensors=[wire_tensors.serialize(t) if t is not None else wire_tensors.empty() for t in tensors],
        metadata=ForwardRequest(active_adapter=adapter).to_bytes(),
    )


async def _call(
    p2p: P2P,
    peer_id: str,
    rpcs: tuple[str, str],
    request: runtime_pb2.ExpertRequest,
    names: tuple[str, ...],
    timeout: float,
) -> list[runtime_pb2.Tensor]:
    """The unary RPC when the request fits in one message, else the stream RPC."""
    async with remote_errors(peer_id, timeout):
        if request.ByteSize() <= UNARY_LIMIT_BYTES:
            response = await asyncio.wait_for(
                p2p.call_protobuf_handler(peer(peer_id), rpcs[0], request, runtime_pb2.ExpertResponse),
                timeout,
            )
            return list(response.tensors)
        return await asyncio.wait_for(_stream(p2p, peer_id, rpcs[1], request, names), timeout)


async def _stream(
    p2p: P2P, peer_id: str, rpc: str, request: runtime_pb2.ExpertRequest, names: tuple[str, ...]
) -> list[runtime_pb2.Tensor]:
    stream = await Stream.open(p2p, peer(peer_id), rpc)
    try:
        for i, chunk in enumerate(wire_tensors.split_tensors(request.tensors)):
            head = {"uid": request.uid, "metadata": request.metadata} if i == 0 else {}
            await stream.send(runtime_pb2.ExpertRequest(tensors=[chunk], **head))
        parts: list[runtime_pb2.Tensor] = []
        while wire_tensors.count_expected_chunks(parts, len(names)) != len(parts):
            if (response := await stream.receive(runtime_pb2.ExpertResponse)) is None:
                short = peer_id[-6:]
                raise ServerUnavailable(f"server ...{short} sent an incomplete reply ({len(parts)} chunks)")
            parts.extend(response.tensors)
        await stream.end()  # our side stays open until the whole reply is here: the daemon may cut its tail
    finally:
        stream.close()
    return wire_tensors.combine_tensors(parts, names)
