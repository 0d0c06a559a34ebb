"""Frames: steps sent down a chain without waiting for the replies to earlier ones (pipelined speculation).

A frame is a plain step of one or more tokens at a position past the frames still in flight. The client
sends it to the first hop and goes on; each hop's replies are read in order by a reader of their own,
which records them in the hop's history and sends the client's copy on to the next hop (byte for byte
the bytes a push carries, so a server runs each frame once, whichever copy comes first), and the last
hop's reply resolves the frame. So every server computes one frame while the next is on its way, and
the chain is never idle for a round trip.

A frame that goes back (its position is before what the servers hold: the first frame after a rejected
draft) is a rollback, and opens an epoch: every frame carries its epoch, and a server skips frames of
epochs before the latest it took (a frame past a rejected draft that has not reached it yet runs nothing
there, and the client sends no copy of it on). A server takes a pushed frame of a later epoch only if it
opens that epoch, at a position it holds: a later frame pushed ahead of its rollback could sit where the
rolled-back frames had left the session and run on their keys and values. So rollbacks travel pushed,
like every other frame, through servers that say they keep epochs (`SpanStream.epochs`). Through others
a rollback is sent by the client to each hop once the previous one replied, and until every hop has
replied to it later frames are not pushed either. A pipe's first frame is never pushed: after a token
tree it names, per hop, the path to keep.

Nothing here replaces a server: a failure ends the pipe (`failed`), the frames already sent get their
replies where their servers answer, and the caller goes on with a synchronous step, whose chain fails
over (client/chain/chain.py) from histories that match what each server holds. A server silent for its
pace that then misses a ping fails the pipe, and the chain's next step to it at once
(client/chain/silent_hops.py).
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from dataclasses import dataclass, field

import torch
from hivemind.proto import runtime_pb2

from corolla.client.chain.chain import Chain
from corolla.client.rpc.span_stream import Sent, Step, StepRoute, StepSkipped
from corolla.errors import RETRYABLE, ServerUnavailable


@dataclass
class Frame:
    position: int
    push: bool  # its copies may be pushed from server to server
    epoch: int
    opens: bool  # it goes back: its epoch starts with it
    step_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    outputs: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    pushed_to: set[str] = field(default_factory=set)  # sessions the previous servers push it to


class FramePipe:
    def __init__(self, chain: Chain, frontier: int):
        self.chain = chain
        self.frontier = frontier  # the end of what the servers may hold (frames past the verified ones too)
        self.links = list(chain.links)  # a failover happens after the pipe, never during it
        self.failed: BaseException | None = None
        self._queues: list[asyncio.Queue[tuple[Frame, Step, StepRoute, Sent] | None]] = [
            asyncio.Queue() for _ in self.links
        ]
        self._readers = [asyncio.create_task(self._read(index)) for index in range(len(self.links))]
        self._rollback: Frame | None = None  # the last unpushed rollback, until every hop replied to it
        self._told: set[int] = set()  # the hops sent a frame already (the first names a tree's kept path)
        self.epoch = max(link.stream.epoch for link in self.links)

    async def send(self, hidden: torch.Tensor, position: int) -> asyncio.Future:
        """Send a frame [1, T, H] at `position`; the future resolves with the last hop's outputs [1, T, H]
        (or the failure that ended the pipe)."""
        rollback = position < self.frontier
        if rollback:
            self.epoch += 1
        if self._rollback is not None and self._rollback.outputs.done():
            self._rollback = None
        # the first frame keeps the path of a token tree (each hop told which: client copies only)
        unpushed = not self._told or rollback and not all(link.stream.epochs for link in self.links)
        frame = Frame(position, not unpushed and self._rollback is None, self.epoch, rollback)
        self.frontier = position + hidden.shape[1]
        if unpushed:
            self._rollback = frame
        if self.failed is not None:
            self._fail(frame, self.failed)
        else:
            await self._send_to(0, frame, hidden, None)
        return frame.outputs

    async def close(self) -> None:
        """Wait for every frame sent to be replied to (or to fail), then stop the readers."""
        for queue in self._queues:
            await queue.join()
        for queue in self._queues:
            queue.put_nowait(None)
        await asyncio.gather(*self._readers, return_exceptions=True)

    async def _send_to(
        self, index: int, frame: Frame, hidden: torch.Tensor, encoded: runtime_pb2.Tensor | None
    ) -> None:
        push = frame.push and self.chain.swarm.config.use_push
        route = self.chain.step_route(index, frame.step_id, push, frame.pushed_to)
        link = self.links[index]
        # a hop's first frame names the path of its token tree to keep (if any); later ones nothing
        accepted = None if index in self._told else link.history.accepted_at(frame.position)
        self._told.add(index)
        step = Step(hidden, frame.position, accepted=accepted, epoch=frame.epoch, opens_epoch=frame.opens)
        try:
            sent = await link.stream.send(step, route, encoded)
        except RETRYABLE as e:
            self._fail(frame, e)
            return
        frame.pushed_to.update(server.session_id for server in route.next_servers)
        self._queues[index].put_nowait((frame, step, route, sent))

    async def _read(self, index: int) -> None:
        """Hop `index`'s replies, in the order its frames were sent."""
        link = self.links[index]
        queue = self._queues[index]
        while (entry := await queue.get()) is not None:
            frame, step, route, sent = entry
            try:
                if self.failed is not None:  # the next hops may be gone: the pipe ends here
                    link.stream.forget(sent)
                    raise self.failed
                receive = functools.partial(link.stream.receive, sent)
                reply = await self.chain.silent_hops.watch(receive, link.hop.peer_id, True, frame=True)
                link.history.record(step, reply.outputs)
                if reply.num_foreign:  # the previous server pushed other inputs; ours ran too
                    self.chain.push_trust.distrust(route.push_from, link.hop.peer_id)
                if frame.epoch < self.epoch:  # past a rejected draft: no further
                    self._drop(frame)
                elif index + 1 < len(self.links):
                    await self._send_to(index + 1, frame, reply.outputs, reply.encoded)
                elif not frame.outputs.done():
                    frame.outputs.set_result(reply.outputs)
            except StepSkipped as e:  # the server had left its epoch: fine for a frame of a dropped one
                if frame.epoch < self.epoch:
                    self._drop(frame)
                else:
                    self._fail(frame, ServerUnavailable(f"{e}, yet its epoch is the latest"))
            except RETRYABLE as e:
                self._fail(frame, e)
            finally:
                queue.task_done()

    @staticmethod
    def _drop(frame: Frame) -> None:
        """A frame of a dropped epoch: nobody reads its outputs (its future resolves with None)."""
        if not frame.outputs.done():
            frame.outputs.set_result(None)

    def _fail(self, frame: Frame, error: BaseException) -> None:
        if self.failed is None:
            self.failed = error
        if not frame.outputs.done():
            frame.outputs.set_exception(error)
            frame.outputs.exception()  # retrieved: the caller may no longer await this frame
