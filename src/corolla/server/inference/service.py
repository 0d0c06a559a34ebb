"""The inference-session protocol on a server: the one owner of a session's steps and its position.

A session is one `rpc_inference` stream: its first message opens the session, every message is a step,
and every step gets exactly one reply, whichever of its copies ran it. With push, the previous server of
a chain sends the step here too (`rpc_push`), often before the client's copy; the copy that arrives
first runs, the other is recognised by the step ledger (server/inference/ledger.py) and runs nothing, and the
reply goes to the client as soon as the step has run. A reply names the position and digest of the inputs it
ran (wire/digest.py): a pushed copy unlike the client's (a lying previous server) may run and reply first,
then the client's copy runs and replies too, and the client takes only the reply to its own inputs.

Taking a step is atomic: its position is checked against the session's, the ledger records it, the
engine receives it (with an absolute position: append, or roll back to an earlier one) and the session's
position moves past it, all in one turn of the event loop. No other copy or step can slip in between, so
two steps can never be run at the same position, and every later step is checked against the position
the earlier ones left. A step that fails in the engine ends the session (the client fails over).

A session belongs to the peer that opened it: only its stream steps it, and a push is taken only from
the peer its owner named as the previous hop, on behalf of that same owner (server/inference/push.py). A
session takes at most PIPELINE_DEPTH steps ahead of their replies: a client has to read its replies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from functools import partial

import torch

from corolla.config import MAX_PIPELINE, ServerConfig
from corolla.engine.async_engine import ResultStream, StepDropped
from corolla.engine.sequence import StepWork
from corolla.errors import CorollaError, InvalidRequest, ServerUnavailable
from corolla.models.handoff import WireLayout
from corolla.server.hosting.spans import HostedSpans
from corolla.server.inference.push import Pusher
from corolla.server.inference.sessions import Completed, ServerSession
from corolla.server.inference.step_inputs import (
    StepInputs,
    StepMessage,
    check_hops,
    next_within,
    read_inputs,
    read_opening,
    takes_push,
)
from corolla.wire import tensors as wire_tensors
from corolla.wire.digest import step_digest
from corolla.wire.messages import InferenceStep

logger = logging.getLogger(__name__)

PIPELINE_DEPTH = MAX_PIPELINE  # steps a session may have taken and not yet been replied to


class InferenceService:
    def __init__(
        self,
        spans: HostedSpans,
        config: ServerConfig,
        width: int,
        pusher: Pusher | None,
        num_blocks: int = 2**31,
        prompt_size: int | None = None,
        wire: WireLayout | None = None,
    ):
        self.spans = spans
        self.config = config
        self.width = width  # of hidden states on the wire (models/handoff.py)
        self.wire = wire  # its layout, where the token ids it carries are checked
        self.prompt_size = prompt_size or width  # of deep prompts: the model's hidden size
        self.pusher = pusher
        self.num_blocks = num_blocks  # the model's: every block range a step names lies within it
        self.draining = False  # set on shutdown: open sessions finish, new ones go elsewhere
        self.steps_from_client = self.steps_from_push = 0  # which copy of each step did the work
        self.rollbacks_from_push = 0  # of those pushed, rollbacks opening an epoch of pipelined frames
        self.steps_announced = 0  # announcements taken: the previous server started computing a step
        self.frames_dropped = 0  # frames of a dropped epoch that a rollback took out of the queue unrun

    # --- a session: the client's stream ---------------------------------------------------------------------

    async def serve(
        self, first: StepMessage, later: AsyncIterator[StepMessage], peer: str
    ) -> AsyncIterator[Completed]:
        """Open a session of `peer` with `first`, then run every step of `later`; one reply per step."""
        if self.draining:
            raise ServerUnavailable("this server is shutting down and takes no new sessions")
        meta = first.meta
        backend, blocks = self.spans.select(first.uid, new_session=True)
        self.spans.check_adapter(meta.active_adapter)
        hidden, encoding = read_opening(first, self.config, self.width, self.num_blocks, self.wire)
        async with backend.sessions.open(peer, meta, blocks, hidden.shape[0]) as session:
            opened = (session.session_id, peer[-6:], *blocks, hidden.shape[0])
            logger.debug("Session %s opened by ...%s: blocks %d:%d, batch %d", *opened)
            try:
                inputs_digest = step_digest(first.tensors, meta.tree, meta.accepted)
                inputs = self._inputs(session, first, inputs_digest, hidden)
                session.push_from = meta.push_from
                session.output_encoding = encoding
                self._run(session, first.meta, inputs, pushed=False)
                async for reply in self._replies(session, later):
                    yield reply
            finally:
                if self.pusher is not None:
                    self.pusher.end_session(*session.key)

    async def _replies(
        self, session: ServerSession, later: AsyncIterator[StepMessage]
    ) -> AsyncIterator[Completed]:
        """Each step's reply as soon as it ran, while taking the client's next steps as they come. At the
        end of the client's stream, the steps already taken still run and get their replies."""
        reading: asyncio.Future | None = None
        more = True  # the client's stream may still bring steps
        completion = asyncio.ensure_future(session.completed.get())
        try:
            while more or session.num_unreported:
                if more and reading is None and session.num_unreported < PIPELINE_DEPTH:
                    reading = asyncio.ensure_future(self._next_step(session, later))
                waiting = [f for f in (reading, completion) if f is not None]
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if completion.done():
                    done = completion.result()
                    session.num_unreported -= 1
                    completion = asyncio.ensure_future(session.completed.get())
                    if done.error is not None:
                        raise done.error
                    unran = done.refused is not None or done.skipped
                    if unran or session.ledger.claim_reply(done.step_id, done.run):
                        yield done
                elif reading is not None and reading.done():
                    step = reading.result()
                    reading = None
                    if step is None:
                        more = False
                    else:
                        self._take_or_refuse(session, step)
        finally:  # nothing may read the client's stream after this (an error reply drains it)
            waiting = [f for f in (reading, completion) if f is not None]
            for future in waiting:
                future.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)

    async def _next_step(
        self, session: ServerSession, later: AsyncIterator[StepMessage]
    ) -> StepMessage | None:
        return await next_within(later, session.time_left(self.config.step_timeout))

    # --- a step pushed by the previous server -------------------------------------------------------------

    def take_push(self, step: StepMessage, sender: str) -> None:
        """A step pushed here by `sender`, the previous server of a chain; it runs unless the session
        cannot take it.

        A push is taken only from the peer that the session's owner named as its previous hop, on behalf
        of that owner (its `origin`); any other push has no effect, whether or not the session exists
        (server/inference/push.py). A push for a session that is not open, that does not land where the
        session stands (step_inputs.py `takes_push`: its next position in its epoch, or a rollback opening
        a later epoch), or whose tensors do not fit the session, is skipped: the client's own copy does the
        work. A push without tensors announces the step (ServerSession.take_announcement). A push
        carrying more than hidden states (prompts are the client's to send), naming other blocks than its
        session's, or reusing a taken step id is an error.
        """
        meta = step.meta
        if len(step.tensors) > 1:
            raise InvalidRequest("a pushed step carries hidden_states only (never prompts or hypo_ids)")
        check_hops(meta, self.num_blocks)
        session = self.spans.find_session(meta.origin, meta.session_id)
        if session is None or session.push_from != sender:
            return
        if not step.tensors:  # an announcement: the step is being computed
            self.steps_announced += session.take_announcement(meta)
            return
        if not takes_push(session, meta):
            return
        if self.spans.select(step.uid, new_session=False)[1] != session.blocks:
            span = f"{session.start}:{session.end}"
            raise InvalidRequest(f"uid: the pushed step's blocks differ from the session's {span}")
        inputs_digest = step_digest(step.tensors, meta.tree, meta.accepted)
        if session.ledger.is_second_copy(meta.step_id, meta.start_from_position, inputs_digest):
            return
        if session.ledger.conflicts(meta.step_id):
            raise InvalidRequest(f"step_id {meta.step_id!r} was already taken here with other inputs")
        try:
            inputs = self._inputs(session, step, inputs_digest)
        except CorollaError as e:
            logger.debug("Skipping a pushed step %s: %s", meta.step_id, e)
            return
        self._run(session, meta, inputs, pushed=True)
        self.rollbacks_from_push += meta.opens_epoch

    # --- taking a step ------------------------------------------------------------------------------------

    def _take_or_refuse(self, session: ServerSession, step: StepMessage) -> None:
        """A step that fails its checks is refused (an error reply), and the session goes on: the checks
        change nothing, so the session is as if the step had never been sent."""
        try:
            self._take_from_client(session, step)
        except InvalidRequest as e:
            logger.debug("Refused a step of session %s: %s", session.session_id, e)
            session.refuse(step.meta.step_id, e)

    def _take_from_client(self, session: ServerSession, step: StepMessage) -> None:
        """Run the client's copy of a step, unless it is a second copy of a step already taken (its
        pushed twin ran first). Checked before the tensors are even read: half of a chain's steps are
        second copies. A client's copy that differs from a pushed copy of the same id runs again (the
        session's owner decides what runs); a client reusing its own step id for another step gets an
        error."""
        if step.refused is not None:  # its metadata failed the wire's checks
            raise step.refused
        meta = step.meta
        check_hops(meta, self.num_blocks)
        if meta.epoch < session.epoch:  # a frame past a rejected draft, its epoch dropped: nothing runs
            session.skip(meta.step_id)
            return
        inputs_digest = step_digest(step.tensors, meta.tree, meta.accepted)
        if session.ledger.is_second_copy(meta.step_id, meta.start_from_position, inputs_digest):
            session.push_from = meta.push_from
            return
        if session.ledger.conflicts(meta.step_id, with_clients_copy=True):
            raise InvalidRequest(
                f"step_id {meta.step_id!r} was already used by this session for another step "
                "(other inputs or another position)"
            )
        inputs = self._inputs(session, step, inputs_digest)  # a step that fails a check changes nothing
        session.push_from = meta.push_from
        self._run(session, meta, inputs, pushed=False)

    def _inputs(
        self,
        session: ServerSession,
        step: StepMessage,
        inputs_digest: bytes,
        hidden: torch.Tensor | None = None,
    ) -> StepInputs:
        sizes = (self.width, self.prompt_size)
        return read_inputs(session, step, inputs_digest, sizes, self.config, hidden, self.wire)

    def _run(self, session: ServerSession, meta: InferenceStep, inputs: StepInputs, pushed: bool) -> None:
        """Take a step: ledger, engine and position in one go, synchronous on purpose (see above)."""
        run = session.ledger.take(meta.step_id, inputs.position, inputs.digest, pushed)
        work = StepWork(
            session.engine_session,
            inputs.hidden,
            inputs.position,
            inputs.prompts,
            inputs.hypo_ids,
            inputs.tree,
            inputs.accepted,
            admit_deadline=session.admit_deadline,
        )
        if meta.next_servers and self.pusher is not None:  # the next server hears when it starts
            work.announce = partial(self.pusher.announce, meta, inputs.position, *session.key)
        if meta.epoch > session.epoch:  # a rollback past a rejected draft: the frames after it are void
            session.drop_earlier_epochs(meta.epoch)
        stream = session.engine.stream()
        session.engine.submit(work, stream)
        session.in_flight[work.request_id] = meta.epoch
        session.position = inputs.position + inputs.length
        session.epoch = max(session.epoch, meta.epoch)
        session.tree = (inputs.position, inputs.tree) if inputs.tree is not None else None
        session.path_before_tree = inputs.accepted if inputs.tree is not None else None
        session.num_unreported += 1
        task = asyncio.create_task(self._complete(session, meta, work, stream, run, pushed, inputs.digest))
        session.running.add(task)
        task.add_done_callback(session.running.discard)

    async def _complete(
        self,
        session: ServerSession,
        meta: InferenceStep,
        work: StepWork,
        stream: ResultStream,
        run: int,
        pushed: bool,
        inputs_digest: bytes,
    ) -> None:
        """Wait for a taken step's outputs, push them on, then queue its reply (naming what ran)."""
        try:
            outputs = wire_tensors.encode(await stream.next(), session.output_encoding)
            if pushed:
                self.steps_from_push += 1
            else:
                self.steps_from_client += 1
            if meta.next_servers and self.pusher is not None:
                # the push leaves before the reply: one hop to the next server beats two through the client
                await self.pusher.push(outputs, meta, work.position, *session.key)
            ran = Completed(meta.step_id, run, outputs, position=work.position, inputs=inputs_digest.hex())
            session.completed.put_nowait(ran)
        except StepDropped:  # a frame of a dropped epoch, dropped before it ran: nothing is pushed
            self.frames_dropped += 1
            session.completed.put_nowait(Completed(meta.step_id, run, skipped=True))
        except asyncio.CancelledError:
            session.engine.abort(work.request_id)
            raise
        except Exception as e:  # the step did not run: the session's cache no longer follows its steps
            error = e if isinstance(e, CorollaError) else ServerUnavailable(f"{type(e).__name__}: {e}")
            session.completed.put_nowait(Completed(meta.step_id, run, error=error))
        finally:
            session.in_flight.pop(work.request_id, None)
