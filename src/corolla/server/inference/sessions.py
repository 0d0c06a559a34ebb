"""Inference sessions on one hosted span: their ids, limits, deadlines and state, and their lifetime.

A session exists from the first `rpc_inference` message to the end of its stream. It belongs to the peer
that opened it (its owner, authenticated by libp2p): session ids are chosen by clients and are no
secrets, so sessions are kept by (owner, session id), and another peer naming the same id opens its own
session or finds nothing, never someone else's. `SessionRegistry.open` checks that the id is free for
its owner and that the owner is within its share of sessions, then opens the engine's session; leaving
the context closes it whatever happened (normal end, error, timeout, vanished client): its running
steps are cancelled and the engine frees its cache pages at its next pass. The protocol that runs steps
in a session is the inference service's (server/inference/service.py); this module only holds a session's
state.

Reused prefixes: a session may start from a position of another session of the same owner,
open or ended and kept (engine/forks.py), its cache pages shared; a session whose owner asked to keep it
and whose stream ended normally is kept idle for such forks (engine/idle.py), never at anyone's cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from hivemind.proto import runtime_pb2

from corolla.engine.async_engine import AsyncEngine
from corolla.engine.sequence import EngineSession
from corolla.errors import InvalidRequest, ServerUnavailable, SessionTimeout
from corolla.models.tree import TokenTree
from corolla.server.inference.ledger import StepLedger
from corolla.wire.messages import InferenceStep


@dataclass(frozen=True, slots=True)
class Completed:
    """A step of the session has run (or failed): what its one reply carries."""

    step_id: str | None
    run: int  # the ledger's run number of this copy
    outputs: runtime_pb2.Tensor | None = None  # serialized once, for the reply and the push alike
    error: Exception | None = None  # the step failed: the session ends
    refused: str | None = None  # the step failed its checks and never ran: the session goes on
    skipped: bool = False  # a step of an epoch before the session's latest: it never ran
    # where the step ran and the digest of its inputs (hex, wire/digest.py): its reply names them
    position: int | None = None
    inputs: str | None = None


@dataclass(eq=False)
class ServerSession:
    session_id: str
    owner: str  # the peer id that opened it: only its stream steps it
    engine: AsyncEngine
    engine_session: EngineSession
    start: int  # absolute block range this session runs
    end: int
    batch_size: int
    max_length: int
    deadline: float  # monotonic time after which the session is closed
    admit_deadline: float  # monotonic time after which its first step may no longer wait for cache
    # positions of the steps taken so far: moved (by the inference service only) in the same event-loop
    # turn as the engine receives each step, so it is also where the next step appends
    position: int = 0
    ledger: StepLedger = field(default_factory=StepLedger)
    completed: asyncio.Queue[Completed] = field(default_factory=asyncio.Queue)
    running: set[asyncio.Task] = field(default_factory=set)  # steps taken, not yet completed
    num_unreported: int = 0  # steps taken whose completion the session's stream has not read yet
    push_from: str | None = None  # the peer the owner named as its previous hop: the only one that may push
    # the token tree of the last step taken (start, tree), until the next step keeps one path of it
    tree: tuple[int, TokenTree] | None = None
    # the path of the tree before that the tree step kept (`accepted`): a client retrying the tree step
    # after a failover names it again, not knowing that this session took the step already (by push)
    path_before_tree: tuple[int, ...] | None = None
    output_encoding: str = "lossless"  # of its replies and pushes, as its owner asked (wire/tensors.py)
    epoch: int = 0  # the latest epoch of the steps taken (pipelined frames: wire/messages.py InferenceStep)
    in_flight: dict[int, int] = field(default_factory=dict)  # engine request id -> epoch, of steps taken

    @property
    def key(self) -> tuple[str, str]:
        return self.owner, self.session_id

    @property
    def blocks(self) -> tuple[int, int]:
        return self.start, self.end

    def refuse(self, step_id: str | None, error: Exception) -> None:
        """A step that failed its checks changes nothing: it gets an error reply, after the replies of the
        steps taken before it."""
        self._reply_in_turn(Completed(step_id, 0, refused=str(error)))

    def skip(self, step_id: str | None) -> None:
        """A step of a dropped epoch runs nothing: its reply says so, after those of the steps before it."""
        self._reply_in_turn(Completed(step_id, 0, skipped=True))

    def drop_earlier_epochs(self, epoch: int) -> None:
        """A step opening `epoch` (a rollback past a rejected draft) voids the frames taken before it in
        earlier epochs: those still queued in the engine are dropped unrun (their replies say skipped);
        one already in a pass completes as usual."""
        for request_id, taken in list(self.in_flight.items()):
            if taken < epoch:
                self.engine.drop(request_id)

    def take_announcement(self, meta: InferenceStep) -> bool:
        """The previous server started computing this session's next step (a push without tensors): the
        engine expects it in `due_in` seconds (engine/batching.py). About any other step, it says nothing.
        Whether it was taken."""
        if meta.due_in is None or meta.start_from_position != self.position:
            return False
        self.engine.announce(self.engine_session.session_id, time.monotonic() + meta.due_in)
        return True

    def _reply_in_turn(self, reply: Completed) -> None:
        self.num_unreported += 1
        earlier = list(self.running)

        async def in_turn() -> None:
            await asyncio.gather(*earlier, return_exceptions=True)
            self.completed.put_nowait(reply)

        task = asyncio.create_task(in_turn())
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    def time_left(self, step_timeout: float) -> float:
        """How long to wait for the next step: the step timeout, cut short by the session's deadline."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise SessionTimeout(f"session {self.session_id} reached the server's session_timeout")
        return min(step_timeout, left)


class SessionRegistry:
    """The open sessions of one engine, by id."""

    def __init__(self, engine: AsyncEngine, session_timeout: float, max_sessions_per_peer: int = 2**31):
        self.engine = engine
        self.session_timeout = session_timeout
        self.max_sessions_per_peer = max_sessions_per_peer
        self.sessions: dict[tuple[str, str], ServerSession] = {}  # by (owner, session id)
        self._claimed: set[tuple[str, str]] = set()  # keys in use, including sessions still being opened

    def __len__(self) -> int:
        return len(self.sessions)

    def get(self, owner: str | None, session_id: str | None) -> ServerSession | None:
        return self.sessions.get((owner, session_id))

    def num_opened_by(self, owner: str) -> int:
        return sum(key[0] == owner for key in self._claimed)

    def _claim(self, owner: str, session_id: str) -> tuple[str, str]:
        key = (owner, session_id)
        if key in self._claimed:
            raise InvalidRequest(f"session_id {session_id!r} is already in use by one of your sessions here")
        if self.num_opened_by(owner) >= self.max_sessions_per_peer:
            raise ServerUnavailable(
                f"your peer already holds max_sessions_per_peer={self.max_sessions_per_peer} sessions here"
            )
        self._claimed.add(key)
        return key

    @contextlib.asynccontextmanager
    async def open(
        self, owner: str, meta: InferenceStep, blocks: tuple[int, int], batch_size: int
    ) -> AsyncIterator[ServerSession]:
        """Open the session a first message describes (`meta`: its id, max_length, adapter, alloc_timeout,
        and for reused prefixes `fork_of` at its start_from_position and `keep`) for `owner`."""
        session_id = meta.session_id or uuid.uuid4().hex
        key = self._claim(owner, session_id)
        engine_id = _engine_id(owner, session_id)
        ended = False  # the stream ended normally: a session its owner asked to keep is kept for forks
        try:
            opening = functools.partial(
                _open_or_fork, self.engine.engine, engine_id, owner, blocks, batch_size, meta
            )
            engine_session = await self.engine.call(opening)
            now = time.monotonic()
            session = ServerSession(
                session_id,
                owner,
                self.engine,
                engine_session,
                *blocks,
                batch_size,
                meta.max_length,
                deadline=now + self.session_timeout,
                admit_deadline=now + meta.alloc_timeout,
                position=engine_session.position,
            )
            self.sessions[key] = session
            try:
                yield session
                ended = True
            finally:
                del self.sessions[key]
                await _cancel(session.running)
        finally:
            # also when the open itself was cancelled: commands run in order, so this close follows it
            if ended and meta.keep:  # its owner asked to keep it for forks
                self.engine.keep_session(engine_id)
            else:
                self.engine.close_session(engine_id)
            self._claimed.discard(key)


def _engine_id(owner: str, session_id: str) -> str:
    return f"{owner}/{session_id}"  # peer ids are base58: no two keys give one engine id


def _open_or_fork(
    engine, engine_id: str, owner: str, blocks: tuple[int, int], batch_size: int, meta: InferenceStep
) -> EngineSession:
    """The engine's session: a plain one, or (`fork_of`) one starting from another of the owner's."""
    adapter = meta.active_adapter
    if meta.fork_of is None:
        return engine.open_session(engine_id, blocks, batch_size, meta.max_length, adapter, owner)
    source_id = _engine_id(owner, meta.fork_of)
    source = engine.sessions.get(source_id)
    if source is not None and ((source.start, source.end) != blocks or source.adapter != adapter):
        raise InvalidRequest(
            f"fork_of: session {meta.fork_of!r} runs blocks {source.start}:{source.end} with adapter "
            f"{source.adapter!r}, not blocks {blocks[0]}:{blocks[1]} with {adapter!r}"
        )
    if source is not None and batch_size != source.batch_size and source.batch_size != 1:
        raise InvalidRequest(
            f"fork_of: a fork of {source.batch_size} rows keeps them all or starts from one, not {batch_size}"
        )
    rows = None if source is None or batch_size == source.batch_size else [0] * batch_size
    position = meta.start_from_position or 0
    return engine.fork_session(source_id, engine_id, position, owner, rows=rows, max_length=meta.max_length)


async def _cancel(tasks: set[asyncio.Task]) -> None:
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
