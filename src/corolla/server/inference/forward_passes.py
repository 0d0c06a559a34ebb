"""Forward and backward passes (training through the swarm): checked requests in, engine results out.

A pass needs no session and no cache: `forward` runs a span over whole sequences, `backward` recomputes
it with autograd and returns the gradients wrt its inputs and deep prompts (the weights stay frozen).
The engine runs this work between inference passes, in row slices, so chat users keep their latency.
One peer may have at most `max_passes_per_peer` passes running or queued here at once.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import torch
from hivemind.proto import runtime_pb2

from corolla.config import ServerConfig
from corolla.engine.sequence import BackwardWork, ForwardWork, Gradients
from corolla.errors import InvalidRequest, ServerUnavailable
from corolla.models.handoff import WireLayout
from corolla.server import validation
from corolla.server.hosting.spans import HostedSpans
from corolla.server.inference.step_inputs import next_within
from corolla.wire import tensors as wire_tensors
from corolla.wire.messages import ForwardRequest


class PassService:
    def __init__(
        self,
        spans: HostedSpans,
        config: ServerConfig,
        width: int,
        prompt_size: int | None = None,
        wire: WireLayout | None = None,
    ):
        self.spans = spans
        self.config = config
        self.width = width  # of hidden states on the wire (models/handoff.py)
        self.wire = wire  # its layout, where the token ids it carries are checked
        self.prompt_size = prompt_size or width  # of deep prompts: the model's hidden size
        self._running: Counter[str] = Counter()  # passes running or queued, by peer

    @contextlib.contextmanager
    def _turn(self, peer: str) -> Iterator[None]:
        limit = self.config.max_passes_per_peer
        if self._running[peer] >= limit:
            raise ServerUnavailable(
                f"your peer already has max_passes_per_peer={limit} forward/backward requests running here"
            )
        self._running[peer] += 1
        try:
            yield
        finally:
            self._running[peer] -= 1
            if not self._running[peer]:
                del self._running[peer]

    async def collect(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], num_tensors: int
    ) -> tuple[str, bytes, list[runtime_pb2.Tensor]]:
        """A pass sent over a stream (`rpc_forward_stream`, `rpc_backward_stream`): its uid, metadata and the
        chunks of its tensors, each message read within the step timeout. The inputs' first
        chunk declares their shape, checked at once; the stream is refused as soon as it goes past its
        byte limit, announces more chunks than that limit allows, or sends a message without tensors."""
        uid = ""
        metadata = b""
        parts = []
        received = 0
        limit = self.stream_limit()
        while (request := await next_within(requests, self.config.step_timeout)) is not None:
            if not request.tensors:
                raise InvalidRequest(f"stream: a message after {len(parts)} chunks carries no tensors")
            if not parts:
                uid = request.uid
                metadata = request.metadata
                # the inputs' first chunk declares their whole shape: refuse an oversized pass at once
                limits = (self.config.max_batch_size, self.config.max_forward_tokens)
                validation.check_pass_hidden(request.tensors[0], self.width, *limits)
            parts.extend(request.tensors)
            received += sum(len(part.buffer) for part in request.tensors)
            if received > limit:
                raise InvalidRequest(f"stream carries more than {limit} bytes, the limit for this server")
            expected = wire_tensors.count_expected_chunks(parts, num_tensors, limit)
            if expected is not None and len(parts) > expected:
                raise InvalidRequest(
                    f"stream carries {len(parts)} chunks, its first chunks announce {expected}"
                )
            if expected == len(parts):
                break
        if not parts:
            raise InvalidRequest("the stream carried no tensors")
        return uid, metadata, parts

    async def forward(
        self, uid: str, meta: ForwardRequest, protos: list[runtime_pb2.Tensor], peer: str = ""
    ) -> torch.Tensor:
        """Tensors: hidden_states [B, T, H], prompts (empty or [blocks, B or 1, P, H]). Returns [B, T, H]."""
        with self._turn(peer):
            return await self._forward(uid, meta, protos)

    async def backward(
        self, uid: str, meta: ForwardRequest, protos: list[runtime_pb2.Tensor], peer: str = ""
    ) -> Gradients:
        """Tensors: inputs [B, T, H], grad_outputs [B, T, H], prompts (empty or [blocks, B or 1, P, H])."""
        with self._turn(peer):
            return await self._backward(uid, meta, protos)

    async def _forward(
        self, uid: str, meta: ForwardRequest, protos: list[runtime_pb2.Tensor]
    ) -> torch.Tensor:
        backend, blocks = self.spans.select(uid, new_session=False)
        self.spans.check_adapter(meta.active_adapter)
        hidden = self._read_inputs(protos)
        batch, length = hidden.shape[:2]
        prompts = validation.read_prompts(protos, blocks[1] - blocks[0], batch, self.prompt_size, length)
        return await backend.engine.run(ForwardWork(hidden, blocks, prompts, adapter=meta.active_adapter))

    async def _backward(self, uid: str, meta: ForwardRequest, protos: list[runtime_pb2.Tensor]) -> Gradients:
        backend, blocks = self.spans.select(uid, new_session=False)
        self.spans.check_adapter(meta.active_adapter)
        inputs = self._read_inputs(protos)
        grad_outputs = validation.read_grad_outputs(protos, inputs)
        batch, length = inputs.shape[:2]
        num_blocks = blocks[1] - blocks[0]
        prompts = validation.read_prompts(
            protos, num_blocks, batch, self.prompt_size, length, index=2, expand=False
        )
        adapter = meta.active_adapter
        work = BackwardWork(
            hidden=inputs, blocks=blocks, prompts=prompts, adapter=adapter, grad_outputs=grad_outputs
        )
        return await backend.engine.run(work)

    def stream_limit(self) -> int:
        """The most bytes a forward or backward stream may carry: inputs, gradients and prompts."""
        longest = max(b.blocks[1] - b.blocks[0] for b in self.spans.backends)
        return (2 + longest) * self.config.max_forward_tokens * self.width * 4

    def _read_inputs(self, protos: list[runtime_pb2.Tensor]) -> torch.Tensor:
        """The inputs, checked against max_forward_tokens from their declared shape before decoding."""
        if protos:
            limits = (self.config.max_batch_size, self.config.max_forward_tokens)
            validation.check_pass_hidden(protos[0], self.width, *limits)
        return validation.read_hidden(protos, self.width, self.config.max_batch_size, wire=self.wire)


def output_compression(meta: ForwardRequest) -> int:
    """How the reply's tensors are to be compressed (NONE unless the caller asked for FLOAT16)."""
    compression = wire_tensors.NONE if meta.output_compression is None else meta.output_compression
    if compression not in (wire_tensors.NONE, wire_tensors.FLOAT16):
        raise InvalidRequest(
            f"output_compression={compression} is not supported (use 0 = NONE or 2 = FLOAT16)"
        )
    return compression
