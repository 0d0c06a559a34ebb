"""The server's RPC layer: wire messages <-> the services, and nothing else.

Handler names follow Petals ("TransformerConnectionHandler.rpc_*"). Each handler parses metadata into
typed messages, hands them to the service that owns the work (inference sessions: server/inference/service.py;
forward and backward passes: server/inference/forward_passes.py; the status: server/status.py) and encodes
what comes back. Any error a request causes is raised as a typed `CorollaError`; its text goes to the caller
(swarm/p2p/stream_handlers.py for streams, hivemind for unary calls), and only that request or session
ends. An unexpected error is logged with its traceback and reaches the caller as a `ServerUnavailable`,
never as a raw Python exception (server/rpc_errors.py).

What arrives is bounded before it is used: every read of a stream waits at most the step timeout, each
stream message at most the bytes its handler's limits allow (a session's own, after its first message;
refused from the length header, before the body is read: swarm/p2p/stream_handlers.py), a tensor stream at
most its byte limit and the chunk count that limit allows, and hidden states are checked against the
session's or pass's limits from their declared shape, before they are decoded.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from corolla.engine.sequence import Gradients
from corolla.errors import InvalidRequest, NotAllowed
from corolla.server import validation
from corolla.server.inference.forward_passes import PassService, output_compression
from corolla.server.inference.service import InferenceService, StepMessage, next_within
from corolla.server.inference.sessions import Completed
from corolla.server.rpc_errors import Unary, reading_to_the_end, typed_errors
from corolla.server.status import StatusBoard
from corolla.swarm.p2p.stream_handlers import ProtobufHandlers, limit_messages
from corolla.wire import messages
from corolla.wire import tensors as wire_tensors
from corolla.wire.messages import ForwardRequest, InferenceStep, StepReply

logger = logging.getLogger(__name__)

ExpertRequest = runtime_pb2.ExpertRequest
ExpertResponse = runtime_pb2.ExpertResponse


class TransformerConnectionHandler:
    def __init__(self, inference: InferenceService, passes: PassService, status: StatusBoard):
        self.inference = inference
        self.passes = passes
        self.status = status
        self.config = inference.config
        self.width = inference.width
        self.step_timeout = inference.config.step_timeout

    async def add_p2p_handlers(self, p2p: P2P) -> None:
        await self.register(ProtobufHandlers(p2p))

    async def register(self, registry: ProtobufHandlers) -> None:
        """Every handler, each stream's with the longest message it may carry (`registry`: a P2P's, or a
        test's in-process network)."""
        longest_step = self._step_bytes(self.config.max_batch_size, self.config.inference_max_length)
        pushed_step = validation.max_step_bytes(
            self.width, self.config.max_batch_size, self.config.inference_max_length, num_blocks=0
        )
        streams = {
            messages.RPC_INFERENCE: (self.rpc_inference, longest_step),
            messages.RPC_FORWARD_STREAM: (self.rpc_forward_stream, validation.max_chunk_bytes()),
            messages.RPC_BACKWARD_STREAM: (self.rpc_backward_stream, validation.max_chunk_bytes()),
            messages.RPC_PUSH: (self.rpc_push, pushed_step),  # hidden states only
        }
        for name, (handler, max_bytes) in streams.items():
            stream = self._admitted_stream(name, handler)
            await registry.add_stream_handler(name, stream, ExpertRequest, max_bytes)
        unary = {
            messages.RPC_FORWARD: (self.rpc_forward, ExpertRequest),
            messages.RPC_BACKWARD: (self.rpc_backward, ExpertRequest),
            messages.RPC_INFO: (self.rpc_info, runtime_pb2.ExpertUID),
        }
        for name, (handler, request_type) in unary.items():
            await registry.add_unary_handler(name, self._admitted(handler), request_type)

    def _step_bytes(self, batch: int, length: int) -> int:
        """The longest step message of a session of `batch` rows and `length` tokens on this server."""
        num_blocks = max(end - start for start, end in (b.blocks for b in self.inference.spans.backends))
        return validation.max_step_bytes(self.width, batch, length, num_blocks)

    # --- a private swarm's admission ----------------------------------------------------------------------

    def _admit(self, context: P2PContext) -> None:
        allowed = self.config.swarm.allowed_peers
        if allowed is not None and (peer := str(context.remote_id)) not in allowed:
            logger.info("Refused a request from ...%s: not an allowed peer", peer[-6:])
            raise NotAllowed(
                f"peer {peer} is not allowed in this private swarm (see the server's --allowed-peers)"
            )

    def _admitted(self, handler: Unary) -> Unary:
        @functools.wraps(handler)
        async def admitted(request: Any, context: P2PContext) -> Any:
            self._admit(context)
            return await handler(request, context)

        return admitted

    def _admitted_stream(self, name: str, handler: Callable[..., AsyncIterator[ExpertResponse]]) -> Callable:
        @functools.wraps(handler)
        async def admitted(requests: AsyncIterator[ExpertRequest], context: P2PContext):
            async with reading_to_the_end(requests, name):
                self._admit(context)
            async for reply in handler(requests, context):
                yield reply

        return admitted

    # --- inference ------------------------------------------------------------------------------------------

    async def rpc_inference(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertResponse]:
        """One inference session on a chain of this server's blocks; one reply per step."""
        async with reading_to_the_end(requests, "rpc_inference"):
            request = await next_within(requests, self.step_timeout)
            if request is None:
                return
            if not request.tensors:
                raise InvalidRequest(
                    "the first rpc_inference message must carry hidden_states (it was empty)"
                )
            meta = InferenceStep.from_bytes(request.metadata, first=True)
            longest, limit = self._session_length(meta)
            batch = self._check_step(request, longest, limit)
            limit_messages(context, self._step_bytes(batch, longest))  # this session's steps, no longer
            first = StepMessage(request.uid, meta, list(request.tensors))
            later = _later_steps(requests, lambda step: self._check_step(step, longest, limit))
            async for reply in self.inference.serve(first, later, str(context.remote_id)):
                yield _reply(reply)

    async def rpc_push(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertResponse]:
        """Steps pushed by the previous server of a chain, over one stream per session; nothing comes back.

        A link idle for the step timeout is closed: its session here has timed out too, or the pusher's
        next push opens a new link.
        """
        async with reading_to_the_end(requests, "rpc_push"):
            sender = str(context.remote_id)
            while (request := await next_within(requests, self.step_timeout)) is not None:
                self._check_step(request, self.config.inference_max_length, "inference_max_length")
                meta = InferenceStep.from_push_bytes(request.metadata)
                self.inference.take_push(StepMessage(request.uid, meta, list(request.tensors)), sender)
        return
        yield  # an async generator: hivemind's stream handlers are

    def _session_length(self, meta: InferenceStep) -> tuple[int, str]:
        """The longest step (tokens per row) this session may take, and the name of that limit."""
        if meta.max_length is not None and meta.max_length <= self.config.inference_max_length:
            return meta.max_length, "the session's max_length"
        return self.config.inference_max_length, "inference_max_length"

    def _check_step(self, request: ExpertRequest, max_length: int, limit: str) -> int:
        """A step's hidden states against the session's limits, from their declared shape: an oversized
        step is refused before anything decodes it. Returns its batch size (0 without tensors)."""
        if not request.tensors:
            return 0
        batch_limit = self.config.max_batch_size
        shape = validation.check_hidden(request.tensors[0], self.width, batch_limit, max_length, limit)
        return shape[0]

    # --- forward and backward passes ------------------------------------------------------------------------

    @typed_errors
    async def rpc_forward(self, request: ExpertRequest, context: P2PContext) -> ExpertResponse:
        meta = ForwardRequest.from_bytes(request.metadata)
        compression = output_compression(meta)
        outputs = await self.passes.forward(request.uid, meta, list(request.tensors), str(context.remote_id))
        return ExpertResponse(tensors=[wire_tensors.serialize(outputs, compression)])

    async def rpc_forward_stream(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertResponse]:
        async with reading_to_the_end(requests, "rpc_forward_stream"):
            uid, metadata, parts = await self.passes.collect(requests, num_tensors=2)
            meta = ForwardRequest.from_bytes(metadata)
            compression = output_compression(meta)
            tensors = wire_tensors.combine_tensors(parts, ("hidden_states", "prompts"))
            outputs = await self.passes.forward(uid, meta, tensors, str(context.remote_id))
            for chunk in wire_tensors.split(wire_tensors.serialize(outputs, compression)):
                yield ExpertResponse(tensors=[chunk])
            await self._until_end(requests)

    @typed_errors
    async def rpc_backward(self, request: ExpertRequest, context: P2PContext) -> ExpertResponse:
        meta = ForwardRequest.from_bytes(request.metadata)
        compression = output_compression(meta)
        grads = await self.passes.backward(request.uid, meta, list(request.tensors), str(context.remote_id))
        return ExpertResponse(tensors=[wire_tensors.serialize(g, compression) for g in _grad_tensors(grads)])

    async def rpc_backward_stream(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertResponse]:
        async with reading_to_the_end(requests, "rpc_backward_stream"):
            uid, metadata, parts = await self.passes.collect(requests, num_tensors=3)
            meta = ForwardRequest.from_bytes(metadata)
            compression = output_compression(meta)
            tensors = wire_tensors.combine_tensors(parts, ("inputs", "grad_outputs", "prompts"))
            grads = await self.passes.backward(uid, meta, tensors, str(context.remote_id))
            for grad in _grad_tensors(grads):
                for chunk in wire_tensors.split(wire_tensors.serialize(grad, compression)):
                    yield ExpertResponse(tensors=[chunk])
            await self._until_end(requests)

    async def _until_end(self, requests: AsyncIterator[ExpertRequest]) -> None:
        """Wait for the caller's end of stream (or the reply's tail may be cut), at most the step timeout."""
        while await next_within(requests, self.step_timeout) is not None:
            pass

    # --- status ---------------------------------------------------------------------------------------------

    @typed_errors
    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        return runtime_pb2.ExpertInfo(serialized_info=self.status.snapshot().to_bytes())


def _reply(reply: Completed) -> ExpertResponse:
    if reply.refused is not None:  # the step never ran; the session goes on
        return ExpertResponse(metadata=StepReply(reply.step_id, error=reply.refused, epochs=True).to_bytes())
    if reply.skipped:  # a frame of a dropped epoch: nothing ran
        return ExpertResponse(metadata=StepReply(reply.step_id, skipped=True, epochs=True).to_bytes())
    ran = StepReply(reply.step_id, position=reply.position, inputs=reply.inputs, epochs=True)
    return ExpertResponse(tensors=[reply.outputs], metadata=ran.to_bytes())


def _grad_tensors(grads: Gradients) -> list[torch.Tensor]:
    """Gradients in wire order: wrt the inputs, then wrt the prompts (empty without prompts)."""
    return [grads.inputs, grads.prompts if grads.prompts is not None else torch.empty(0)]


async def _later_steps(
    requests: AsyncIterator[ExpertRequest], check: Callable[[ExpertRequest], None]
) -> AsyncIterator[StepMessage]:
    """The client's steps after the first, each `check`ed; an empty message (or the end of the stream)
    ends the session. A step whose metadata fails its checks (a `tree` of strings, say) is refused on its
    own when it names its step_id; the session goes on. The service reads them within its step timeout."""
    async for request in requests:
        if not request.tensors:
            return
        try:
            meta = InferenceStep.from_bytes(request.metadata, first=False)
        except InvalidRequest as error:
            step_id = InferenceStep.step_id_of(request.metadata)
            if step_id is None:  # a reply could not name the step: the session ends with the error
                raise
            yield StepMessage(request.uid, InferenceStep(step_id), list(request.tensors), refused=error)
            continue
        check(request)
        yield StepMessage(request.uid, meta, list(request.tensors))
