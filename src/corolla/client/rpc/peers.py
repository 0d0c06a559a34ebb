"""How this client talks to servers: the only place in the client that opens a stream or sends a request.

Everything else (chains, passes, checks, routing) asks `Peers`, which knows the transport, the model's
DHT prefix, the request timeout, the adapter and how a request's hidden states are encoded. A test
gives it an in-process transport instead of the network; nothing above it changes.

Forward and backward passes use the unary RPC when the request fits in one message; the libp2p daemon caps
those at 4 MiB, so larger requests go over a stream in chunks. A stream's sender keeps its side open until
the whole reply has arrived (otherwise the daemon may cut the reply's tail), and the reply's chunk count
is checked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch
from hivemind.proto import runtime_pb2

from corolla.client.rpc.span_stream import Opening, SpanStream
from corolla.config import ClientConfig
from corolla.errors import InvalidRequest, ServerUnavailable
from corolla.swarm.p2p.ping import Ping, ping
from corolla.swarm.p2p.transport import Transport, remote_errors
from corolla.swarm.policy.routing import Hop
from corolla.wire import tensors as wire_tensors
from corolla.wire.messages import (
    RPC_BACKWARD,
    RPC_BACKWARD_STREAM,
    RPC_FORWARD,
    RPC_FORWARD_STREAM,
    RPC_INFERENCE,
    ForwardRequest,
)
from corolla.wire.records import ServerStatus, block_uids

PING_TIMEOUT = 2.0
UNARY_LIMIT_BYTES = 3 * 2**20  # under the daemon's 4 MiB cap, with room for metadata and framing


class Peers:
    def __init__(self, transport: Transport, dht_prefix: str, config: ClientConfig):
        self.transport = transport
        self.dht_prefix = dht_prefix
        self.timeout = config.request_timeout
        self.adapter = config.active_adapter

    async def ping(self, peer_id: str) -> Ping:
        return await ping(self.transport, peer_id, PING_TIMEOUT)

    async def open_session(self, hop: Hop, opening: Opening, encoding: str) -> SpanStream:
        """An inference session's stream to hop's server (the session opens with its first step)."""
        async with remote_errors(hop.peer_id, self.timeout):
            stream = await asyncio.wait_for(
                self.transport.open_stream(hop.peer_id, RPC_INFERENCE), self.timeout
            )
        uid = block_uids(self.dht_prefix, hop.start, hop.end)
        return SpanStream(stream, hop, uid, opening, encoding, self.timeout)

    async def forward(
        self, hop: Hop, hidden: torch.Tensor, prompts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run blocks [hop.start, hop.end) on hop's server over hidden states [B, T, H]."""
        request = self._request(hop, [hidden, prompts])
        reply = await self._call(hop.peer_id, (RPC_FORWARD, RPC_FORWARD_STREAM), request, ("outputs",))
        outputs = wire_tensors.deserialize(reply[0], "outputs") if reply else None
        if outputs is None or outputs.shape != hidden.shape:
            raise ServerUnavailable(f"server ...{hop.peer_id[-6:]} returned a malformed forward reply")
        return outputs

    async def backward(
        self,
        hop: Hop,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor,
        prompts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients wrt the inputs [B, T, H] of blocks [hop.start, hop.end) and wrt their deep prompts
        (None without prompts), given the gradient of the outputs."""
        request = self._request(hop, [inputs, grad_outputs, prompts])
        names = ("grad_inputs", "grad_prompts")
        reply = await self._call(hop.peer_id, (RPC_BACKWARD, RPC_BACKWARD_STREAM), request, names)
        grads = [wire_tensors.deserialize(proto, name) for proto, name in zip(reply, names, strict=False)]
        if len(grads) != 2 or grads[0].shape != inputs.shape:
            raise ServerUnavailable(f"server ...{hop.peer_id[-6:]} returned a malformed backward reply")
        if prompts is None:
            return grads[0], None
        if grads[1].shape[0] != prompts.shape[0] or grads[1].shape[2:] != prompts.shape[2:]:
            raise ServerUnavailable(f"server ...{hop.peer_id[-6:]} returned malformed prompt gradients")
        return grads[0], grads[1]

    def _request(self, hop: Hop, tensors: list[torch.Tensor | None]) -> runtime_pb2.ExpertRequest:
        """A forward/backward request for the hop's blocks; an absent tensor (None) is sent empty."""
        return runtime_pb2.ExpertRequest(
            uid=block_uids(self.dht_prefix, hop.start, hop.end),
            tensors=[wire_tensors.serialize(t) if t is not None else wire_tensors.empty() for t in tensors],
            metadata=ForwardRequest(active_adapter=self.adapter).to_bytes(),
        )

    async def _call(
        self, peer_id: str, rpcs: tuple[str, str], request: runtime_pb2.ExpertRequest, names: tuple[str, ...]
    ) -> list[runtime_pb2.Tensor]:
        """The unary RPC when the request fits in one message, else the stream RPC."""
        async with remote_errors(peer_id, self.timeout):
            if request.ByteSize() <= UNARY_LIMIT_BYTES:
                call = self.transport.call(peer_id, rpcs[0], request, runtime_pb2.ExpertResponse)
                return list((await asyncio.wait_for(call, self.timeout)).tensors)
            return await asyncio.wait_for(self._stream(peer_id, rpcs[1], request, names), self.timeout)

    async def _stream(
        self, peer_id: str, rpc: str, request: runtime_pb2.ExpertRequest, names: tuple[str, ...]
    ) -> list[runtime_pb2.Tensor]:
        stream = await self.transport.open_stream(peer_id, rpc)
        try:
            for i, chunk in enumerate(wire_tensors.split_tensors(request.tensors)):
                head = {"uid": request.uid, "metadata": request.metadata} if i == 0 else {}
                await stream.send(runtime_pb2.ExpertRequest(tensors=[chunk], **head))
            parts: list[runtime_pb2.Tensor] = []
            while wire_tensors.count_expected_chunks(parts, len(names)) != len(parts):
                if (response := await stream.receive(runtime_pb2.ExpertResponse)) is None:
                    short = peer_id[-6:]
                    raise ServerUnavailable(
                        f"server ...{short} sent an incomplete reply ({len(parts)} chunks)"
                    )
                parts.extend(response.tensors)
            await (
                stream.end()
            )  # our side stays open until the whole reply is here: the daemon may cut its tail
        finally:
            stream.close()
        return wire_tensors.combine_tensors(parts, names)


def hop_encodings(wanted: str, statuses: Sequence[ServerStatus | None]) -> list[tuple[str, str]]:
    """Per hop of a chain (its servers' reports, None where unknown), the encoding of its inputs and of
    its outputs: `wanted` where that server (and, for its outputs, the next one, which takes them by push)
    reads it; else lossless."""
    if wanted not in wire_tensors.supported_encodings():
        available = ", ".join(wire_tensors.supported_encodings())
        raise InvalidRequest(f"wire_encoding {wanted!r} is not available here ({available})")

    def reads(status: ServerStatus | None) -> bool:
        return wanted == "lossless" or (status is not None and wanted in status.encodings)

    pairs = []
    for i, status in enumerate(statuses):
        inbound = wanted if reads(status) else "lossless"
        later = statuses[i + 1 : i + 2]
        pairs.append((inbound, inbound if all(reads(s) for s in later) else "lossless"))
    return pairs
