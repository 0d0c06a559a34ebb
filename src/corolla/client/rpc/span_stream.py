"""One server's part of an inference session: an open `rpc_inference` stream for blocks [start, end).

The first message carries the session's parameters (max_length, session_id, alloc_timeout, adapter,
output encoding) with the first step's tensors; every message gets exactly one reply, whose shape is
checked. A reply to a step abandoned earlier (its step id is not the one awaited) is skipped, and so is a
reply that names other inputs than the step's (its position and the digest of its tensors, tree and kept
path: wire/digest.py): the outputs of a copy that the previous server pushed and the client never sent.
The server runs the client's copy too and replies to it; the chain decides what a forged push means.
Closing sends the end of stream and waits for the server to finish, so the server frees the cache at once.

A span stream keeps no history: what the server's cache was built from is the chain's
(client/chain/hop_history.py). A server that dies with a step in flight is noticed when its stream ends, not
at the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch
from hivemind.proto import runtime_pb2
from hivemind.proto.runtime_pb2 import ExpertResponse

from corolla.errors import CorollaError, InvalidRequest, ServerUnavailable, SessionNotFound
from corolla.swarm.p2p.transport import MessageStream, remote_errors
from corolla.swarm.policy.routing import Hop
from corolla.wire import tensors as wire_tensors
from corolla.wire.digest import step_digest
from corolla.wire.messages import InferenceStep, NextServer, StepReply

CLOSE_TIMEOUT = 5.0


class ForkGone(ServerUnavailable):
    """The session this one was to start from is gone from the server (evicted, timed out, or the server
    restarted): nothing ran; the hop is rebuilt by sending its inputs again (client/chain/chain.py)."""


class StepSkipped(CorollaError):
    """The server ran nothing for the step: a frame of an epoch it had already left (pipelined
    speculation, client/chain/frames.py); the frame was past a rejected draft, so nothing is lost."""


class ForgedPush(ServerUnavailable):
    """The server refused the client's copy of a step after it had run a pushed copy with other inputs
    (whose tree path its cache now keeps): the server that pushed it is at fault, not this one."""


@dataclass(frozen=True)
class StepRoute:
    """How a step travels the chain: its id (the same at every hop: a server runs it once, pushed or not),
    the later servers this one pushes its outputs to, whether the previous server pushes it here (its
    reply may then come before our copy is even sent), and the peer this server may take pushes from."""

    step_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    next_servers: tuple[NextServer, ...] = ()
    pushed: bool = False
    push_from: str | None = None


@dataclass(frozen=True)
class Opening:
    """What the first message of a session tells its server."""

    max_length: int
    alloc_timeout: float = 0.0
    active_adapter: str | None = None
    output_encoding: str = "lossless"  # how the server replies and pushes
    fork_of: str | None = None  # start from this session of ours on the server (its first step's position)
    keep: bool = False  # the server keeps the session for later forks once its stream ends


@dataclass(frozen=True)
class Reply:
    outputs: torch.Tensor  # [B, T, H]
    encoded: runtime_pb2.Tensor  # the outputs as the server sent them (the next hop gets these bytes)
    # replies to this step id that named other inputs, skipped: a pushed copy ran that was not this one
    num_foreign: int = 0


@dataclass(frozen=True)
class Step:
    """One step's tensors and where it goes (checked by the session before it is sent)."""

    hidden: torch.Tensor  # [B, T, H]
    position: int
    prompts: torch.Tensor | None = None  # [blocks of this hop, B, P, H]
    hypo_ids: torch.Tensor | None = None  # [B]
    tree: tuple[int, ...] | None = None  # parents of the T tokens (models/tree.py)
    accepted: tuple[int, ...] | None = None  # the path of the server's pending tree to keep
    epoch: int | None = None  # of pipelined frames (client/chain/frames.py); None: the latest sent
    opens_epoch: bool = False  # a frame going back to before the frames of earlier epochs


class SpanStream:
    def __init__(
        self, stream: MessageStream, hop: Hop, uid: str, opening: Opening, encoding: str, timeout: float
    ):
        self.hop = hop
        self.uid = uid
        self.opening = opening
        self.timeout = timeout
        self.encoding = encoding  # what the server reads from us
        self.session_id = uuid.uuid4().hex
        self._stream: MessageStream | None = stream
        self._opened = False
        # replies to steps in flight that came before the reply awaited (a step that is pushed on completes
        # after the unpushed step taken behind it), kept until their turn; other early replies are dropped
        self._in_flight: set[str] = set()
        self._early: dict[str, list[ExpertResponse]] = {}
        self.epoch = 0  # the latest epoch of the steps sent
        self.epochs = False  # the server said it keeps epochs: a rollback may be pushed to it

    @property
    def closed(self) -> bool:
        return self._stream is None

    async def step(self, step: Step, route: StepRoute, encoded: runtime_pb2.Tensor | None = None) -> Reply:
        """Send a step and wait for its reply. `encoded`: the hidden states as the previous server replied
        them, sent on as they came (byte for byte its push: the server runs the step once)."""
        sent = await self.send(step, route, encoded)
        return await self.receive(sent)

    async def send(self, step: Step, route: StepRoute, encoded: runtime_pb2.Tensor | None = None) -> Sent:
        """Send a step without waiting for its reply; `receive` reads it. Several steps may be in flight
        (pipelined speculation): their replies are read in the order the steps were sent."""
        stream = self._live()
        encoded = encoded if encoded is not None else wire_tensors.encode(step.hidden, self.encoding)
        request = self._request(step, route, encoded)
        inputs = step_digest(request.tensors, step.tree, step.accepted)
        sent = Sent(route.step_id, step.position, inputs.hex(), step.hidden.shape)
        async with self._failing(stream):
            await asyncio.wait_for(stream.send(request), self.timeout)
        self._in_flight.add(sent.step_id)
        return sent

    async def receive(self, sent: Sent) -> Reply:
        """The reply to the step `sent` (every step sent before it was received already)."""
        stream = self._live()
        async with self._failing(stream):
            try:
                response = await self._reply_to(stream, sent)
            finally:
                self._in_flight.discard(sent.step_id)
                self._early.pop(sent.step_id, None)
            return self._read(response, sent.shape, sent.num_foreign)

    def forget(self, sent: Sent) -> None:
        """A step sent whose reply nobody will read (a pipe of frames ended before it)."""
        self._in_flight.discard(sent.step_id)
        self._early.pop(sent.step_id, None)

    def _live(self) -> MessageStream:
        if self._stream is None:
            raise ServerUnavailable(f"the session with server ...{self.hop.peer_id[-6:]} is already closed")
        return self._stream

    @contextlib.asynccontextmanager
    async def _failing(self, stream: MessageStream) -> AsyncIterator[None]:
        """Errors as the client reads them; a failed stream takes no more steps (a cancelled read leaves it
        unreadable). A step the server skipped was replied to: the stream goes on."""
        try:
            async with remote_errors(self.hop.peer_id, self.timeout):
                yield
        except StepSkipped:
            raise
        except SessionNotFound as e:  # only a fork's first step names a session other than its own
            self._stream = None
            stream.close()
            gone = ForkGone if self.opening.fork_of is not None else ServerUnavailable
            raise gone(f"server ...{self.hop.peer_id[-6:]}: {e}") from None
        except BaseException:
            self._stream = None
            stream.close()
            raise

    def _request(
        self, step: Step, route: StepRoute, encoded: runtime_pb2.Tensor
    ) -> runtime_pb2.ExpertRequest:
        first = {}
        if not self._opened:
            opening = self.opening
            first = dict(
                max_length=opening.max_length,
                session_id=self.session_id,
                alloc_timeout=opening.alloc_timeout,
                active_adapter=opening.active_adapter,
                output_encoding=None if opening.output_encoding == "lossless" else opening.output_encoding,
                fork_of=opening.fork_of,
                keep=opening.keep,
            )
        self._opened = True
        self.epoch = max(self.epoch, step.epoch if step.epoch is not None else self.epoch)
        # the position goes with every step: after a step abandoned midway, servers roll back, not append
        meta = InferenceStep(
            step_id=route.step_id,
            start_from_position=step.position,
            next_servers=route.next_servers,
            push_from=route.push_from,
            tree=step.tree,
            accepted=step.accepted,
            epoch=self.epoch if step.epoch is None else step.epoch,
            opens_epoch=step.opens_epoch,
            **first,
        )
        tensors = [encoded]  # trailing absent tensors are simply left out
        if step.prompts is not None or step.hypo_ids is not None:
            prompts = step.prompts
            tensors.append(wire_tensors.serialize(prompts) if prompts is not None else wire_tensors.empty())
        if step.hypo_ids is not None:
            tensors.append(wire_tensors.serialize(step.hypo_ids))
        return runtime_pb2.ExpertRequest(uid=self.uid, tensors=tensors, metadata=meta.to_bytes())

    async def _reply_to(self, stream: MessageStream, sent: Sent) -> ExpertResponse:
        """The reply to the step `sent` (replies to a step abandoned earlier are skipped, and so are replies
        to its id that name other inputs: the server replies to the client's copy too)."""
        while True:
            early = self._early.get(sent.step_id)
            response = (
                early.pop(0)
                if early
                else await asyncio.wait_for(stream.receive(ExpertResponse), self.timeout)
            )
            if response is None:  # the server finished, closed or died: no reply is coming
                raise ConnectionResetError("the stream ended before the reply")
            reply = _reply_meta(response, self.hop.peer_id)
            self.epochs = self.epochs or reply.epochs
            if reply.step_id not in (None, sent.step_id):
                if reply.step_id in self._in_flight:
                    self._early.setdefault(reply.step_id, []).append(response)
                continue
            if reply.skipped:
                raise StepSkipped(f"server ...{self.hop.peer_id[-6:]} skipped a step of a dropped epoch")
            if reply.error is not None:  # the client checked what it sent: this server is at fault...
                fault = ForgedPush if sent.num_foreign else ServerUnavailable  # ... unless a forger is
                raise fault(f"server ...{self.hop.peer_id[-6:]} refused a step: {reply.error}")
            # a server that names no inputs (a Petals-style one) is taken at its word
            if reply.inputs is not None and (reply.inputs, reply.position) != (sent.inputs, sent.position):
                sent.num_foreign += 1
                continue
            return response

    def _read(self, response: ExpertResponse, shape: torch.Size, num_foreign: int) -> Reply:
        encoded = response.tensors[0] if response.tensors else None
        outputs = wire_tensors.deserialize(encoded, "outputs") if encoded is not None else None
        if outputs is None or outputs.shape != shape:
            raise ServerUnavailable(
                f"server ...{self.hop.peer_id[-6:]} returned outputs of shape "
                f"{None if outputs is None else list(outputs.shape)}, expected {list(shape)}"
            )
        return Reply(outputs, encoded, num_foreign)

    async def close(self) -> None:
        stream = self._stream
        self._stream = None
        if stream is None:
            return
        try:  # end our side, then drain: the server frees the cache once its replies are out
            await asyncio.wait_for(_end_and_drain(stream), CLOSE_TIMEOUT)
        except Exception:  # the session is over either way; the server frees it when the stream dies
            pass
        finally:
            stream.close()


@dataclass
class Sent:
    """What the reply to a step must name: its id, and the position and digest (hex) of what was sent;
    the shape its outputs must have."""

    step_id: str
    position: int
    inputs: str
    shape: torch.Size
    num_foreign: int = 0  # replies to its id that named other inputs


async def _end_and_drain(stream: MessageStream) -> None:
    await stream.end()
    while await stream.receive(ExpertResponse) is not None:
        pass


def _reply_meta(response: ExpertResponse, peer_id: str) -> StepReply:
    try:
        return StepReply.from_bytes(response.metadata)
    except InvalidRequest as e:  # a broken or hostile server: the client replaces it
        raise ServerUnavailable(f"server ...{peer_id[-6:]} sent a malformed reply: {e}") from None
