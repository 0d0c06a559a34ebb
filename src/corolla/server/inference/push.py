"""Server-to-server push: a step's outputs go straight to the next server of the chain.

When a step carries `next_servers`, the server that computed it sends its outputs to the first of them
(`rpc_push`) before replying to the client; the receiver runs that step at once and replies to the client
without waiting for the client to relay it (`InferenceService.take_push`). The client still sends every
step itself (it keeps the inputs for failover), and the receiver runs each step once and replies once,
whichever copy arrives first (server/inference/ledger.py). A push that fails changes nothing: the client's
copy does the work.

Session ids are not secrets (they travel to every server of a chain), so a push proves where it comes
from instead: the receiver takes it only from the peer that the session's client named as its previous
hop (`push_from`, authenticated by libp2p), and only if it names that client as its `origin`, the peer
that opened the pushing server's session. An honest server thus never relays one client's hidden states
into another client's session (InferenceService.take_push).

Pushes for one session travel over one open stream to the next server's session (a `PushLink`), opened
by the first push and closed when the session ends here. Opening a libp2p stream per step would cost a
protocol negotiation (a round trip on a real network) every token, and on loopback it made the push lose
its race against the client's copy about one time in five.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.proto import runtime_pb2

from corolla.swarm.p2p.transport import Transport
from corolla.wire.messages import RPC_PUSH, InferenceStep
from corolla.wire.records import block_uids

logger = logging.getLogger(__name__)

# Event-loop turns for a queued push to reach the daemon: the link's task wakes up in one and writes the
# request to its stream, which sends it at once.
HANDOFF_TURNS = 2
OPEN_TIMEOUT = 10.0  # seconds to open a link's stream; its pushes wait in the link meanwhile


class PushLink:
    """One open `rpc_push` stream from a session here to the next server's session."""

    def __init__(self, transport: Transport, peer_id: str):
        self.peer_id = peer_id
        self._queue: asyncio.Queue[runtime_pb2.ExpertRequest | None] = asyncio.Queue()
        self.task = asyncio.create_task(self._run(transport))

    def send(self, request: runtime_pb2.ExpertRequest) -> None:
        self._queue.put_nowait(request)

    def close(self) -> None:
        """Ends the stream after the pushes already queued."""
        self._queue.put_nowait(None)

    async def _run(self, transport: Transport) -> None:
        try:
            # an unreachable peer holds nothing long
            stream = await asyncio.wait_for(transport.open_stream(self.peer_id, RPC_PUSH), OPEN_TIMEOUT)
            try:
                while (request := await self._queue.get()) is not None:
                    await stream.send(request)
                await stream.end()
                while await stream.receive(runtime_pb2.ExpertResponse) is not None:
                    pass  # the receiver sends nothing back; this waits for the end of the stream
            finally:
                stream.close()
        except Exception as e:  # the next push opens a new link; meanwhile the client's copies do the work
            logger.debug("Push link to ...%s ended: %s", self.peer_id[-6:], e)


class Pusher:
    def __init__(self, transport: Transport, dht_prefix: str):
        self.transport = transport
        self.dht_prefix = dht_prefix
        # (our session's client, our session, next peer, its session)
        self._links: dict[tuple[str, str, str, str], PushLink] = {}
        self._closing: set[asyncio.Task] = set()  # links sending their last pushes

    async def push(
        self, outputs: runtime_pb2.Tensor, meta: InferenceStep, position: int, origin: str, from_session: str
    ) -> None:
        """Send a step's outputs (computed at `position` in `from_session`, opened by peer `origin`) on to
        the next server.

        Returns once the request is on its way, without waiting for the receiver: the caller replies to the
        client after this, so the push (one hop to the next server) starts ahead of the client's copy (two
        hops through the client).
        """
        self._send(meta, position, origin, from_session, [outputs])
        for _ in range(HANDOFF_TURNS):
            await asyncio.sleep(0)

    def announce(
        self, meta: InferenceStep, position: int, origin: str, from_session: str, due_in: float
    ) -> None:
        """Tell the next server that the pass computing this step started and that its outputs follow in
        about `due_in` seconds: a push without tensors, over the same link, so it always arrives first
        (engine/batching.py). A server that does not batch by announcements ignores it."""
        self._send(meta, position, origin, from_session, [], due_in=due_in)

    def _send(
        self,
        meta: InferenceStep,
        position: int,
        origin: str,
        from_session: str,
        tensors: list[runtime_pb2.Tensor],
        due_in: float | None = None,
    ) -> None:
        target = meta.next_servers[0]
        step = InferenceStep(
            step_id=meta.step_id,
            start_from_position=position,
            next_servers=meta.next_servers[1:],
            pushed=True,
            session_id=target.session_id,
            origin=origin,
            tree=meta.tree,
            accepted=meta.accepted,
            epoch=meta.epoch,
            opens_epoch=meta.opens_epoch,
            due_in=due_in,
        )
        request = runtime_pb2.ExpertRequest(
            uid=block_uids(self.dht_prefix, target.start, target.end),
            tensors=tensors,
            metadata=step.to_bytes(),
        )
        key = (origin, from_session, target.peer_id, target.session_id)
        link = self._links.get(key)
        if link is None or link.task.done():
            link = self._links[key] = PushLink(self.transport, target.peer_id)
        link.send(request)

    def end_session(self, origin: str, session_id: str) -> None:
        """Close the links of a session that ended here."""
        for key in [key for key in self._links if key[:2] == (origin, session_id)]:
            link = self._links.pop(key)
            link.close()
            self._closing.add(link.task)
            link.task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        tasks = [link.task for link in self._links.values()] + list(self._closing)
        self._links = {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
