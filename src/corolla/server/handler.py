"""The server's RPC layer: wire messages <-> the services, and nothing else.

Handler names follow Petals ("TransformerConnectionHandler.rpc_*"). Each handler parses metadata into
typed messages, hands them to the service that owns the work (inference sessions: server/inference.py;
forward and backward passes: server/passes.py; the status: server/status.py) and encodes what comes
back. Any error a request causes is raised as a typed `CorollaError`; hivemind sends its text to the
caller, and only that request or session ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from corolla.engine.sequence import Gradients
from corolla.errors import CorollaError, InvalidRequest, WireError, wire_text
from corolla.server.inference import InferenceService, StepMessage, next_within
from corolla.server.passes import PassService, output_compression
from corolla.server.sessions import Completed
from corolla.server.status import StatusBoard
from corolla.wire import messages
from corolla.wire import tensors as wire_tensors
from corolla.wire.messages import ForwardRequest, InferenceStep, StepReply

ExpertRequest, ExpertResponse = runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse
ERROR_DRAIN_SECONDS = 0.5


class TransformerConnectionHandler:
    def __init__(self, inference: InferenceService, passes: PassService, status: StatusBoard):
        self.inference, self.passes, self.status = inference, passes, status
        self.step_timeout = inference.config.step_timeout

    async def add_p2p_handlers(self, p2p: P2P) -> None:
        both = dict(stream_input=True, stream_output=True)
        await p2p.add_protobuf_handler(messages.RPC_INFERENCE, self.rpc_inference, ExpertRequest, **both)
        await p2p.add_protobuf_handler(messages.RPC_FORWARD, self.rpc_forward, ExpertRequest)
        await p2p.add_protobuf_handler(
            messages.RPC_FORWARD_STREAM, self.rpc_forward_stream, ExpertRequest, **both
        )
        await p2p.add_protobuf_handler(messages.RPC_BACKWARD, self.rpc_backward, ExpertRequest)
        await p2p.add_protobuf_handler(
            messages.RPC_BACKWARD_STREAM, self.rpc_backward_stream, ExpertRequest, **both
        )
        await p2p.add_protobuf_handler(messages.RPC_INFO, self.rpc_info, runtime_pb2.ExpertUID)
        await p2p.add_protobuf_handler(messages.RPC_PUSH, self.rpc_push, ExpertRequest, **both)

    # --- inference ------------------------------------------------------------------------------------------

    async def rpc_inference(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertResponse]:
        """One inference session on a chain of this server's blocks; one reply per step."""
        async with _reading_to_the_end(requests):
            request = await next_within(requests, self.step_timeout)
            if request is None:
                return
            if not request.tensors:
                raise InvalidRequest(
                    "the first rpc_inference message must carry hidden_states (it was empty)"
                )
            first = StepMessage(
                request.uid, InferenceStep.from_bytes(request.metadata, first=True), list(request.tensors)
            )
            replies = self.inference.serve(first, _later_steps(requests), str(context.remote_id))
            async for reply in replies:
                yield _reply(reply)

    async def rpc_push(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertResponse]:
        """Steps pushed by the previous server of a chain, over one stream per session; nothing comes back."""
        async with _reading_to_the_end(requests):
            async for request in requests:
                meta = InferenceStep.from_push_bytes(request.metadata)
                self.inference.take_push(StepMessage(request.uid, meta, list(request.tensors)))
        return
        yield  # an async generator: hivemind's stream handlers are

    # --- forward and backward passes ------------------------------------------------------------------------

    async def rpc_forward(self, request: ExpertRequest, context: P2PContext) -> ExpertResponse:
        meta = ForwardRequest.from_bytes(request.metadata)
        compression = output_compression(meta)
        outputs = await self.passes.forward(request.uid, meta, list(request.tensors))
        return ExpertResponse(tensors=[wire_tensors.serialize(outputs, compression)])

    async def rpc_forward_stream(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertResponse]:
        async with _reading_to_the_end(requests):
            uid, metadata, parts = await self._collect_stream(requests, num_tensors=2)
            meta = ForwardRequest.from_bytes(metadata)
            compression = output_compression(meta)
            tensors = wire_tensors.combine_tensors(parts, ("hidden_states", "prompts"))
            outputs = await self.passes.forward(uid, meta, tensors)
            for chunk in wire_tensors.split(wire_tensors.serialize(outputs, compression)):
                yield ExpertResponse(tensors=[chunk])
            async for _ in requests:  # wait for the caller's end of stream, or the reply's tail may be cut
                pass

    async def rpc_backward(self, request: ExpertRequest, context: P2PContext) -> ExpertResponse:
        meta = ForwardRequest.from_bytes(request.metadata)
        compression = output_compression(meta)
        grads = await self.passes.backward(request.uid, meta, list(request.tensors))
        return ExpertResponse(tensors=[wire_tensors.serialize(g, compression) for g in _grad_tensors(grads)])

    async def rpc_backward_stream(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertResponse]:
        async with _reading_to_the_end(requests):
            uid, metadata, parts = await self._collect_stream(requests, num_tensors=3)
            meta = ForwardRequest.from_bytes(metadata)
            compression = output_compression(meta)
            tensors = wire_tensors.combine_tensors(parts, ("inputs", "grad_outputs", "prompts"))
            grads = await self.passes.backward(uid, meta, tensors)
            for grad in _grad_tensors(grads):
                for chunk in wire_tensors.split(wire_tensors.serialize(grad, compression)):
                    yield ExpertResponse(tensors=[chunk])
            async for _ in requests:  # wait for the caller's end of stream, or the reply's tail may be cut
                pass

    async def _collect_stream(
        self, requests: AsyncIterator[ExpertRequest], num_tensors: int
    ) -> tuple[str, bytes, list[runtime_pb2.Tensor]]:
        uid, metadata, parts, received = "", b"", [], 0
        limit = self.passes.stream_limit()
        async for request in requests:
            if not parts:
                uid, metadata = request.uid, request.metadata
            parts.extend(request.tensors)
            received += sum(len(part.buffer) for part in request.tensors)
            if received > limit:
                raise InvalidRequest(f"stream carries more than {limit} bytes, the limit for this server")
            if wire_tensors.count_expected_chunks(parts, num_tensors) == len(parts):
                break
        if not parts:
            raise InvalidRequest("the stream carried no tensors")
        return uid, metadata, parts

    # --- status ---------------------------------------------------------------------------------------------

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        return runtime_pb2.ExpertInfo(serialized_info=self.status.snapshot().to_bytes())


def _reply(reply: Completed) -> ExpertResponse:
    return ExpertResponse(tensors=[reply.outputs], metadata=StepReply(reply.step_id).to_bytes())


def _grad_tensors(grads: Gradients) -> list[torch.Tensor]:
    """Gradients in wire order: wrt the inputs, then wrt the prompts (empty without prompts)."""
    return [grads.inputs, grads.prompts if grads.prompts is not None else torch.empty(0)]


async def _later_steps(requests: AsyncIterator[ExpertRequest]) -> AsyncIterator[StepMessage]:
    """The client's steps after the first; an empty message (or the end of the stream) ends the session."""
    async for request in requests:
        if not request.tensors:
            return
        meta = InferenceStep.from_bytes(request.metadata, first=False)
        yield StepMessage(request.uid, meta, list(request.tensors))


@contextlib.asynccontextmanager
async def _reading_to_the_end(requests: AsyncIterator[ExpertRequest]) -> AsyncIterator[None]:
    """On an error, read what the caller already sent before the error reply goes out.

    hivemind closes the stream right after sending an error; closing it with unread incoming data resets
    the connection, and the reset can overtake the error message. Draining first (briefly: a caller that
    waits for our reply sends nothing more) lets the caller read a precise error instead of a broken pipe.
    """
    try:
        yield
    except CorollaError as e:
        deadline = asyncio.get_running_loop().time() + ERROR_DRAIN_SECONDS
        with contextlib.suppress(Exception):
            while (left := deadline - asyncio.get_running_loop().time()) > 0:
                await asyncio.wait_for(anext(requests), left)
        raise WireError(wire_text(e)) from e  # hivemind sends a stream's error as str(): keep the class
