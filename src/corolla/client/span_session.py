"""One server's part of an inference session: an open `rpc_inference` stream for blocks [start, end).

The first message carries the session parameters (max_length, session_id, alloc_timeout, adapter) with
the first step's tensors; every message gets exactly one reply, whose shape is checked. Closing sends
the end of stream and waits for the server to finish, so the server frees the cache at once.

A span session keeps the inputs it has sent (after rollbacks, beam reordering and speculative trees: once
a tree's accepted path is known, only that path is kept), so that if its server fails, a replacement can
be brought to the same state by replaying them (`replay`); with spot checks on, the outputs too. The
server holds the whole tree until the next step names the path to keep (`accepted`). Every step names
its position (the inference session's). A server that dies with a step in flight is noticed when its
stream ends, not at the timeout (swarm/p2p_io.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.proto.runtime_pb2 import ExpertResponse

from corolla.client.swarm import SwarmClient, peer, remote_errors
from corolla.errors import InvalidRequest, ServerUnavailable
from corolla.swarm.p2p_io import Stream
from corolla.swarm.routing import Hop
from corolla.wire import tensors as wire_tensors
from corolla.wire.messages import RPC_INFERENCE, InferenceStep, NextServer, StepReply
from corolla.wire.records import block_uids
from corolla.wire.tensors import supported_encodings

CLOSE_TIMEOUT = 5.0
REPLAY_CHUNK = 512  # tokens per message when replaying a failed server's inputs to its replacement


@dataclass(frozen=True)
class StepRoute:
    """How a step travels the chain: its id (the same at every hop: a server runs it once, pushed or not),
    the later servers this one pushes its outputs to, whether the previous server pushes it here (its
    reply may then come before our copy is even sent), and the peer this server may take pushes from."""

    step_id: str | None = None
    next_servers: tuple[NextServer, ...] = ()
    pushed: bool = False
    push_from: str | None = None


class SpanSession:
    def __init__(  # noqa: PLR0913
        self,
        p2p: P2P,
        hop: Hop,
        dht_prefix: str,
        max_length: int,
        timeout: float,
        alloc_timeout: float = 0.0,
        observe: Callable[[str, float, int], None] | None = None,
        active_adapter: str | None = None,
        encodings: tuple[str, str] = ("lossless", "lossless"),
        keep_outputs: bool = False,
    ):
        self.p2p, self.hop, self.max_length = p2p, hop, max_length
        self.timeout, self.alloc_timeout = timeout, alloc_timeout
        self.active_adapter, self.keep_outputs = active_adapter, keep_outputs
        self.encoding, self.output_encoding = encodings  # what it reads, what it replies and pushes in
        self.reply: runtime_pb2.Tensor | None = None  # the last reply's outputs as they came
        self.observe = observe  # told how long each decode step took: (peer_id, seconds, num_blocks)
        self.uid = block_uids(dht_prefix, hop.start, hop.end)
        self.session_id = uuid.uuid4().hex
        self.inputs: torch.Tensor | None = None  # [B, position, H]: what the server's cache was built from
        self.outputs: torch.Tensor | None = None  # [B, position, H]: its replies, if kept (spot checks)
        self.verified = 0  # positions [0, verified) of those outputs passed a spot check
        self.prompts: torch.Tensor | None = None  # the deep prompts last sent
        # the server's pending token tree: (its start, the path to keep once known), named by the next step
        self.tree: tuple[int, tuple[int, ...] | None] | None = None
        self._stream: Stream | None = None
        self._stepped = self.closed = False

    async def open(self) -> None:
        async with remote_errors(self.hop.peer_id, self.timeout):
            self._stream = await asyncio.wait_for(
                Stream.open(self.p2p, peer(self.hop.peer_id), RPC_INFERENCE), self.timeout
            )

    async def step(  # noqa: PLR0913
        self,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None,
        hypo_ids: torch.Tensor | None,
        start_from_position: int,
        route: StepRoute = StepRoute(),  # noqa: B008 (frozen)
        tree: tuple[int, ...] | None = None,
        encoded: runtime_pb2.Tensor | None = None,
    ) -> torch.Tensor:
        """Send hidden states [B, T, H] for positions [start_from_position, + T); returns the outputs.

        `route`: with next servers, this server also pushes its outputs straight to the next one (which
        then runs the step once, whichever copy arrives first); a pushed step's time says nothing about
        this server. `tree`: the parents of the step's tokens, a token
        tree (models/tree.py); `accept` then names the path of it to keep. `encoded`: the hidden states as
        the previous server replied them, sent on as they came (byte for byte its push: one step).
        """
        if self.closed or self._stream is None:
            raise ServerUnavailable(f"the session with server ...{self.hop.peer_id[-6:]} is already closed")
        step_id = route.step_id or uuid.uuid4().hex
        encoded = encoded if encoded is not None else wire_tensors.encode(hidden, self.encoding)
        request = self._request(encoded, prompts, hypo_ids, start_from_position, step_id, route, tree)
        started = time.perf_counter()
        outputs = await self._reply(self._stream, request, step_id, hidden.shape)
        if self.observe is not None and hidden.shape[1] == 1 and not route.pushed:
            self.observe(self.hop.peer_id, time.perf_counter() - started, self.hop.end - self.hop.start)
        self._remember(hidden, outputs, prompts, hypo_ids, start_from_position)
        self.tree = (start_from_position, None) if tree is not None else None
        return outputs

    def accept(self, path: tuple[int, ...]) -> None:
        """The path (token indices, root first) of the last step's tree that the session keeps: the kept
        inputs become that path at once (a replacement replays it as a plain sequence); the server is told
        with the next step."""
        if self.tree is None or self.inputs is None:
            raise InvalidRequest("accept: the last step was not a token tree")
        start = self.tree[0]
        kept = start + torch.tensor(path, dtype=torch.long)
        self.inputs = torch.cat([self.inputs[:, :start], self.inputs[:, kept]], dim=1)
        if self.outputs is not None:
            self.outputs = torch.cat([self.outputs[:, :start], self.outputs[:, kept]], dim=1)
        self.tree = (start, tuple(path))

    def _accepted(self, position: int) -> tuple[int, ...] | None:
        """What the next step, at `position`, tells the server to keep of its pending tree."""
        if self.tree is None or self.tree[1] is None or position <= self.tree[0]:
            return None
        start, path = self.tree
        return path[: position - start]

    def _request(  # noqa: PLR0913
        self,
        hidden: runtime_pb2.Tensor,
        prompts: torch.Tensor | None,
        hypo_ids: torch.Tensor | None,
        position: int,
        step_id: str,
        route: StepRoute,
        tree: tuple[int, ...] | None = None,
    ) -> runtime_pb2.ExpertRequest:
        first = (
            {}
            if self._stepped
            else dict(
                max_length=self.max_length,
                session_id=self.session_id,
                alloc_timeout=self.alloc_timeout,
                active_adapter=self.active_adapter,
                output_encoding=None if self.output_encoding == "lossless" else self.output_encoding,
            )
        )
        self._stepped = True
        # the position goes with every step: after a step abandoned midway, servers roll back, not append
        meta = InferenceStep(
            step_id=step_id,
            start_from_position=position,
            next_servers=route.next_servers,
            push_from=route.push_from,
            tree=tree,
            accepted=self._accepted(position),
            **first,
        )
        tensors = [hidden]  # trailing absent tensors are simply left out
        if prompts is not None or hypo_ids is not None:
            tensors.append(wire_tensors.serialize(prompts) if prompts is not None else wire_tensors.empty())
        if hypo_ids is not None:
            tensors.append(wire_tensors.serialize(hypo_ids))
        return runtime_pb2.ExpertRequest(uid=self.uid, tensors=tensors, metadata=meta.to_bytes())

    async def _reply(
        self, stream: Stream, request: runtime_pb2.ExpertRequest, step_id: str, shape: torch.Size
    ) -> torch.Tensor:
        """Send a step, then read up to its reply (replies to a step abandoned earlier are skipped)."""
        try:
            async with remote_errors(self.hop.peer_id, self.timeout):
                await asyncio.wait_for(stream.send(request), self.timeout)
                while True:
                    response = await asyncio.wait_for(stream.receive(ExpertResponse), self.timeout)
                    if response is None:  # the server finished, closed or died: no reply is coming
                        raise ConnectionResetError("the stream ended before the reply")
                    reply = _reply_meta(response, self.hop.peer_id)
                    if reply.step_id in (None, step_id):
                        break
        except BaseException:  # a failed stream takes no more steps (a cancelled read leaves it unreadable)
            self.closed, self._stream = True, None
            stream.close()
            raise
        if reply.error is not None:  # the client checked what it sent: this server is at fault
            self.closed = True
            raise ServerUnavailable(f"server ...{self.hop.peer_id[-6:]} refused a step: {reply.error}")
        self.reply = response.tensors[0] if response.tensors else None
        outputs = wire_tensors.deserialize(self.reply, "outputs") if self.reply is not None else None
        if outputs is None or outputs.shape != shape:
            self.closed = True
            raise ServerUnavailable(
                f"server ...{self.hop.peer_id[-6:]} returned outputs of shape "
                f"{None if outputs is None else list(outputs.shape)}, expected {list(shape)}"
            )
        return outputs

    def _remember(  # noqa: PLR0913
        self,
        hidden: torch.Tensor,
        outputs: torch.Tensor,
        prompts: torch.Tensor | None,
        hypo_ids: torch.Tensor | None,
        start_from_position: int,
    ) -> None:
        self.inputs = _extended(self.inputs, hidden, hypo_ids, start_from_position)
        if self.keep_outputs:
            self.outputs = _extended(self.outputs, outputs, hypo_ids, start_from_position)
        self.verified = min(self.verified, start_from_position)
        if hypo_ids is not None and not torch.equal(hypo_ids, torch.arange(len(hypo_ids))):
            self.verified = 0  # rows reordered: a spot check's shadow must see the new rows from the start
        if prompts is not None:
            self.prompts = prompts

    def rewind(self, position: int) -> None:
        """Forget what came at and after `position` (a spot check found it wrong upstream or here)."""
        for name in ("inputs", "outputs"):
            kept = getattr(self, name)
            setattr(self, name, None if kept is None or position == 0 else kept[:, :position])
        self.verified, self.tree = min(self.verified, position), None

    async def replay(self, inputs: torch.Tensor, prompts: torch.Tensor | None) -> torch.Tensor:
        """Rebuild another server's state here: send its inputs [B, T, H] from position 0, in chunks;
        returns this span's outputs for them (the next span's inputs)."""
        outputs = []
        for start in range(0, inputs.shape[1], REPLAY_CHUNK):
            chunk_prompts = prompts if start == 0 else None
            chunk = inputs[:, start : start + REPLAY_CHUNK]
            outputs.append(await self.step(chunk, chunk_prompts, None, start))
        return torch.cat(outputs, dim=1)

    async def close(self) -> None:
        self.closed = True
        stream, self._stream = self._stream, None
        if stream is None:
            return
        try:  # end our side, then drain: the server frees the cache once its replies are out
            await asyncio.wait_for(_end_and_drain(stream), CLOSE_TIMEOUT)
        except Exception:  # the session is over either way; the server frees it when the stream dies
            pass
        finally:
            stream.close()


def hop_encodings(swarm: SwarmClient, hops: list[Hop]) -> list[tuple[str, str]]:
    """Per hop, the encoding of its inputs and of its outputs: the client's wire_encoding where that
    server (and, for its outputs, the next one, which takes them by push) reads it; else lossless."""
    wanted = swarm.config.wire_encoding
    if wanted not in supported_encodings():
        raise InvalidRequest(
            f"wire_encoding {wanted!r} is not available here ({', '.join(supported_encodings())})"
        )

    def reads(hop: Hop) -> bool:
        status = swarm.status_of(hop.peer_id)
        return wanted == "lossless" or (status is not None and wanted in status.encodings)

    pairs = []
    for i, hop in enumerate(hops):
        inbound = wanted if reads(hop) else "lossless"
        later = hops[i + 1 : i + 2]
        pairs.append((inbound, inbound if all(reads(h) for h in later) else "lossless"))
    return pairs


def _extended(
    kept: torch.Tensor | None, new: torch.Tensor, hypo_ids: torch.Tensor | None, position: int
) -> torch.Tensor:
    """Kept per-position tensors [B, P, H] cut at `position`, rows reordered by hypo_ids, then `new`."""
    if kept is not None:
        kept = kept[:, :position]
    if kept is not None and hypo_ids is not None:
        kept = kept[hypo_ids]
    return new if kept is None or kept.shape[1] == 0 else torch.cat([kept, new], dim=1)


async def _end_and_drain(stream: Stream) -> None:
    await stream.end()
    while await stream.receive(ExpertResponse) is not None:
        pass


def _reply_meta(response: runtime_pb2.ExpertResponse, peer_id: str) -> StepReply:
    try:
        return StepReply.from_bytes(response.metadata)
    except InvalidRequest as e:  # a broken or hostile server: the client replaces it
        raise ServerUnavailable(f"server ...{peer_id[-6:]} sent a malformed reply: {e}") from None
