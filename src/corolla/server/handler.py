"""The server's RPC handlers: decode -> validate -> engine -> encode, and nothing else.

Handler names follow Petals ("TransformerConnectionHandler.rpc_*"). Every step and forward request goes
to the server's engine, which batches it with the work of every other session. Any error a request causes
is raised as a typed `CorollaError`; hivemind sends its text to the caller, and only that request or
session ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from corolla.config import ServerConfig
from corolla.engine.sequence import ForwardWork, StepWork
from corolla.errors import CorollaError, InvalidRequest, ServerUnavailable, SessionTimeout
from corolla.server import validation
from corolla.server.backend import SpanBackend
from corolla.server.push import Pusher
from corolla.server.sessions import ServerSession
from corolla.wire import messages
from corolla.wire import tensors as wire_tensors
from corolla.wire.messages import ForwardRequest, InferenceStep, ServerInfo, StepReply

logger = logging.getLogger(__name__)

ExpertRequest, ExpertResponse = runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse
ERROR_DRAIN_SECONDS = 0.5


class TransformerConnectionHandler:
    def __init__(self, backends: list[SpanBackend], config: ServerConfig, dht_prefix: str, version: str):
        self.backends = backends  # shared with the server, which adds one while it moves to other blocks
        self.config, self.dht_prefix = config, dht_prefix
        self.hidden_size = backends[0].span.config.hidden_size
        self.version = version
        self.draining = False  # set on shutdown: open sessions finish, new ones go elsewhere
        self.pusher: Pusher | None = None  # set once the server's p2p is up
        self.steps_from_client = self.steps_from_push = 0  # which copy of each step did the work
        self.adapters: frozenset[str] = frozenset()  # LoRA adapters every hosted span serves

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

    @property
    def primary(self) -> SpanBackend:
        """The backend that takes new sessions (the newest one while moving)."""
        return next((b for b in self.backends if b.accepting), self.backends[0])

    def _select(self, uid: str, new_session: bool) -> tuple[SpanBackend, tuple[int, int]]:
        """The backend hosting the blocks named by `uid`; new sessions go only to an accepting one."""
        error: InvalidRequest | None = None
        for backend in sorted(self.backends, key=lambda b: not b.accepting):
            try:
                blocks = validation.parse_uid(uid, self.dht_prefix, *backend.blocks)
            except InvalidRequest as e:
                error = error or e
                continue
            if new_session and not backend.accepting:
                raise ServerUnavailable(f"this server is moving away from blocks {blocks[0]}:{blocks[1]}")
            return backend, blocks
        raise error

    def _find_session(self, session_id: str) -> ServerSession | None:
        for backend in self.backends:
            if session_id in backend.sessions.sessions:
                return backend.sessions.sessions[session_id]
        return None

    @property
    def num_sessions(self) -> int:
        return sum(len(backend.sessions) for backend in self.backends)

    def _check_adapter(self, adapter: str | None) -> None:
        if adapter is not None and adapter not in self.adapters:
            served = ", ".join(sorted(self.adapters)) or "none"
            raise InvalidRequest(f"active_adapter {adapter!r} is not served here (adapters here: {served})")

    # --- rpc_inference -------------------------------------------------------------------------------------

    async def rpc_inference(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertResponse]:
        """One inference session on a chain of this server's blocks; one reply per step."""
        async with _reading_to_the_end(requests):
            async for response in self._inference(requests, context):
                yield response

    async def _inference(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertResponse]:
        request = await _next_request(requests, self.config.step_timeout)
        if request is None:
            return
        if self.draining:
            raise ServerUnavailable("this server is shutting down and takes no new sessions")
        if not request.tensors:
            raise InvalidRequest("the first rpc_inference message must carry hidden_states (it was empty)")
        meta = InferenceStep.from_bytes(request.metadata, first=True)
        backend, blocks = self._select(request.uid, new_session=True)
        self._check_adapter(meta.active_adapter)
        if meta.max_length > self.config.inference_max_length:
            raise InvalidRequest(
                f"max_length={meta.max_length} exceeds this server's inference_max_length="
                f"{self.config.inference_max_length}"
            )
        batch_size = validation.read_hidden(
            request.tensors, self.hidden_size, self.config.max_batch_size
        ).shape[0]
        async with backend.sessions.open(
            meta.session_id, blocks, batch_size, meta.max_length, meta.active_adapter
        ) as session:
            logger.debug(
                "Session %s opened by ...%s: blocks %d:%d, batch %d, max_length %d",
                session.session_id,
                str(context.remote_id)[-6:],
                *blocks,
                batch_size,
                meta.max_length,
            )
            admit_deadline = time.monotonic() + meta.alloc_timeout
            try:
                async for response in self._steps(session, request, meta, requests, admit_deadline):
                    yield response
            finally:
                if self.pusher is not None:
                    self.pusher.end_session(session.session_id)

    async def _steps(
        self,
        session: ServerSession,
        request: ExpertRequest,
        meta: InferenceStep,
        requests: AsyncIterator[ExpertRequest],
        admit_deadline: float,
    ) -> AsyncIterator[ExpertResponse]:
        """The client's steps from `request` on, and the outputs of steps pushed here; one reply per step.

        While waiting for the client's next step, a pushed step's outputs go to the client as soon as they
        exist: the client then has the chain's outputs one hop after the last server ran.
        """
        reading: asyncio.Future | None = None
        pushed = asyncio.ensure_future(session.pushed.get())
        try:
            while True:
                outputs = await self._step_once(session, list(request.tensors), meta, admit_deadline)
                if session.first_reply(meta.step_id):
                    yield _reply(meta.step_id, outputs)
                timeout = session.time_left(self.config.step_timeout)
                reading = asyncio.ensure_future(_next_request(requests, timeout))
                while not reading.done():
                    await asyncio.wait((reading, pushed), return_when=asyncio.FIRST_COMPLETED)
                    if pushed.done():
                        step_id, outputs = pushed.result()
                        pushed = asyncio.ensure_future(session.pushed.get())
                        if session.first_reply(step_id):
                            yield _reply(step_id, outputs)
                request = reading.result()
                if request is None or not request.tensors:
                    return
                meta = InferenceStep.from_bytes(request.metadata, first=False)
        finally:  # nothing may read the client's stream after this (an error reply drains it)
            waiting = [f for f in (reading, pushed) if f is not None]
            for future in waiting:
                future.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)

    async def _step_once(
        self, session: ServerSession, tensors: list, meta: InferenceStep, admit_deadline: float
    ) -> runtime_pb2.Tensor:
        """Run a step unless it already ran: a step may arrive both by push and from the client.

        The first copy computes it (and pushes it on); the second waits for the same outputs. If a pushed
        copy fails (a pusher may be wrong), the client's copy computes the step itself. Returns the outputs
        serialized once, for the reply and the push alike.
        """
        earlier = session.results.get(meta.step_id) if meta.step_id else None
        if earlier is not None:
            try:
                return await asyncio.shield(earlier)
            except CorollaError:
                if meta.pushed:
                    raise
        future = session.remember(meta.step_id)
        position = session.position if meta.start_from_position is None else meta.start_from_position
        try:
            outputs = wire_tensors.serialize(await self._run_step(session, tensors, meta, admit_deadline))
        except BaseException as e:
            session.forget(meta.step_id, future, e)
            raise
        future.set_result(outputs)
        if meta.pushed:
            self.steps_from_push += 1
        else:
            self.steps_from_client += 1
        if meta.next_servers and self.pusher is not None:
            await self.pusher.push(outputs, meta, position, session.session_id)  # leaves before the reply
        return outputs

    async def _run_step(
        self, session: ServerSession, tensors: list, meta: InferenceStep, admit_deadline: float
    ) -> torch.Tensor:
        hidden = validation.read_hidden(tensors, self.hidden_size, self.config.max_batch_size)
        batch, length = hidden.shape[:2]
        if batch != session.batch_size:
            raise InvalidRequest(
                f"hidden_states: batch size {batch} differs from the session's {session.batch_size}"
            )
        position = session.position
        if meta.start_from_position is not None:
            if meta.start_from_position > position:
                raise InvalidRequest(
                    f"start_from_position={meta.start_from_position} is after the session's "
                    f"current position {position}"
                )
            position = meta.start_from_position
        if position + length > session.max_length:
            raise InvalidRequest(
                f"step of {length} tokens at position {position} goes past the session's "
                f"max_length={session.max_length}"
            )
        prompts = validation.read_prompts(
            tensors, session.end - session.start, batch, self.hidden_size, session.max_length
        )
        hypo_ids = validation.read_hypo_ids(tensors, batch)
        work = StepWork(
            session.engine_session,
            hidden,
            prompts,
            hypo_ids,
            meta.start_from_position,
            admit_deadline=admit_deadline,
        )
        outputs = await session.engine.run(work, session.stream)
        session.position, session.num_steps = position + length, session.num_steps + 1
        return outputs

    # --- rpc_push ------------------------------------------------------------------------------------------

    async def rpc_push(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertResponse]:
        """Steps pushed by the previous server of a chain, over one stream per session; nothing comes back.

        A step this server cannot take yet (its session is not open, or it is at another position) is
        skipped: the client's copy of it does the work. A malformed push ends the stream with an error.
        """
        async with _reading_to_the_end(requests):
            async for request in requests:
                meta = InferenceStep.from_push_bytes(request.metadata)
                session = self._find_session(meta.session_id)
                if session is None or meta.start_from_position != session.position:
                    continue  # not open yet, or stale, early, or a rollback: the client decides
                if self._select(request.uid, new_session=False)[1] != (session.start, session.end):
                    span = f"{session.start}:{session.end}"
                    raise InvalidRequest(f"uid: the pushed step's blocks differ from the session's {span}")
                try:
                    outputs = await self._step_once(session, list(request.tensors), meta, time.monotonic())
                except CorollaError as e:  # this copy failed; the client's copy runs the step itself
                    logger.debug("Pushed step %s failed: %s", meta.step_id, e)
                else:
                    session.pushed.put_nowait((meta.step_id, outputs))
        return
        yield  # an async generator: hivemind's stream handlers are

    # --- rpc_forward ---------------------------------------------------------------------------------------

    async def rpc_forward(self, request: ExpertRequest, context: P2PContext) -> ExpertResponse:
        outputs, compression = await self._forward(request.uid, request.metadata, list(request.tensors))
        return ExpertResponse(tensors=[wire_tensors.serialize(outputs, compression)])

    async def rpc_forward_stream(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertResponse]:
        async with _reading_to_the_end(requests):
            uid, metadata, parts = await self._collect_stream(requests, num_tensors=2)
            tensors = wire_tensors.combine_tensors(parts, ("hidden_states", "prompts"))
            outputs, compression = await self._forward(uid, metadata, tensors)
            for chunk in wire_tensors.split(wire_tensors.serialize(outputs, compression)):
                yield ExpertResponse(tensors=[chunk])
            async for _ in requests:  # wait for the caller's end of stream, or the reply's tail may be cut
                pass

    # --- rpc_backward --------------------------------------------------------------------------------------

    async def rpc_backward(self, request: ExpertRequest, context: P2PContext) -> ExpertResponse:
        grads, compression = await self._backward(request.uid, request.metadata, list(request.tensors))
        return ExpertResponse(tensors=[wire_tensors.serialize(g, compression) for g in grads])

    async def rpc_backward_stream(
        self, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> AsyncIterator[ExpertResponse]:
        async with _reading_to_the_end(requests):
            uid, metadata, parts = await self._collect_stream(requests, num_tensors=3)
            tensors = wire_tensors.combine_tensors(parts, ("inputs", "grad_outputs", "prompts"))
            grads, compression = await self._backward(uid, metadata, tensors)
            for grad in grads:
                for chunk in wire_tensors.split(wire_tensors.serialize(grad, compression)):
                    yield ExpertResponse(tensors=[chunk])
            async for _ in requests:  # wait for the caller's end of stream, or the reply's tail may be cut
                pass

    async def _backward(
        self, uid: str, metadata: bytes, protos: list[runtime_pb2.Tensor]
    ) -> tuple[list[torch.Tensor], int]:
        """Tensors: inputs [B, T, H], grad_outputs [B, T, H], prompts (empty or [blocks, B or 1, P, H]).
        Returns [grad wrt inputs, grad wrt prompts (empty without prompts)]."""
        meta = ForwardRequest.from_bytes(metadata)
        backend, blocks = self._select(uid, new_session=False)
        self._check_adapter(meta.active_adapter)
        compression = self._compression(meta)
        inputs = self._read_forward_inputs(protos)
        grad_outputs = validation.read_grad_outputs(protos, inputs)
        batch, length = inputs.shape[:2]
        prompts = validation.read_prompts(
            protos, blocks[1] - blocks[0], batch, self.hidden_size, length, index=2, expand=False
        )
        work = ForwardWork(inputs, blocks, prompts, grad_outputs, meta.active_adapter)
        grad_inputs, grad_prompts = await backend.engine.run(work)
        return [grad_inputs, grad_prompts if grad_prompts is not None else torch.empty(0)], compression

    async def _collect_stream(
        self, requests: AsyncIterator[ExpertRequest], num_tensors: int
    ) -> tuple[str, bytes, list[runtime_pb2.Tensor]]:
        uid, metadata, parts, received = "", b"", [], 0
        longest = max(b.blocks[1] - b.blocks[0] for b in self.backends)
        limit = (2 + longest) * self.config.max_forward_tokens * self.hidden_size * 4
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

    async def _forward(self, uid: str, metadata: bytes, protos: list[runtime_pb2.Tensor]):
        meta = ForwardRequest.from_bytes(metadata)
        backend, blocks = self._select(uid, new_session=False)
        self._check_adapter(meta.active_adapter)
        compression = self._compression(meta)
        hidden = self._read_forward_inputs(protos)
        batch, length = hidden.shape[:2]
        prompts = validation.read_prompts(protos, blocks[1] - blocks[0], batch, self.hidden_size, length)
        work = ForwardWork(hidden, blocks, prompts, adapter=meta.active_adapter)
        return await backend.engine.run(work), compression

    @staticmethod
    def _compression(meta: ForwardRequest) -> int:
        compression = wire_tensors.NONE if meta.output_compression is None else meta.output_compression
        if compression not in (wire_tensors.NONE, wire_tensors.FLOAT16):
            raise InvalidRequest(
                f"output_compression={compression} is not supported (use 0 = NONE or 2 = FLOAT16)"
            )
        return compression

    def _read_forward_inputs(self, protos: list[runtime_pb2.Tensor]) -> torch.Tensor:
        hidden = validation.read_hidden(protos, self.hidden_size, self.config.max_batch_size)
        batch, length = hidden.shape[:2]
        if batch * length > self.config.max_forward_tokens:
            raise InvalidRequest(
                f"hidden_states: {batch} x {length} tokens exceed max_forward_tokens="
                f"{self.config.max_forward_tokens}"
            )
        return hidden

    # --- rpc_info ------------------------------------------------------------------------------------------

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        return runtime_pb2.ExpertInfo(serialized_info=self.info().to_bytes())

    def info(self) -> ServerInfo:
        primary = self.primary
        stats = primary.engine.stats
        return ServerInfo(
            version=self.version,
            dht_prefix=self.dht_prefix,
            start=primary.blocks[0],
            end=primary.blocks[1],
            dtype=str(primary.span.dtype).replace("torch.", ""),
            inference_max_length=self.config.inference_max_length,
            max_batch_size=self.config.max_batch_size,
            cache_tokens_total=stats.total_cache_tokens,
            cache_tokens_available=stats.free_cache_tokens,
            num_sessions=self.num_sessions,
            queued_tokens=sum(b.engine.stats.queued_tokens for b in self.backends),
            engine_passes=sum(b.engine.stats.num_passes for b in self.backends),
            engine_rows=sum(b.engine.stats.total_rows for b in self.backends),
            steps_from_client=self.steps_from_client,
            steps_from_push=self.steps_from_push,
        )


def _reply(step_id: str | None, outputs: runtime_pb2.Tensor) -> ExpertResponse:
    return ExpertResponse(tensors=[outputs], metadata=StepReply(step_id).to_bytes())


@contextlib.asynccontextmanager
async def _reading_to_the_end(requests: AsyncIterator[ExpertRequest]) -> AsyncIterator[None]:
    """On an error, read what the caller already sent before the error reply goes out.

    hivemind closes the stream right after sending an error; closing it with unread incoming data resets
    the connection, and the reset can overtake the error message. Draining first (briefly: a caller that
    waits for our reply sends nothing more) lets the caller read a precise error instead of a broken pipe.
    """
    try:
        yield
    except CorollaError:
        deadline = asyncio.get_running_loop().time() + ERROR_DRAIN_SECONDS
        with contextlib.suppress(Exception):
            while (left := deadline - asyncio.get_running_loop().time()) > 0:
                await asyncio.wait_for(anext(requests), left)
        raise


async def _next_request(requests: AsyncIterator[ExpertRequest], timeout: float) -> ExpertRequest | None:
    try:
        return await asyncio.wait_for(anext(requests), timeout)
    except StopAsyncIteration:
        return None
    except (asyncio.TimeoutError, TimeoutError):
        raise SessionTimeout(f"no request arrived within step_timeout={timeout:.1f}s") from None
