"""Inference sessions on one hosted span: their ids, limits, deadlines and state, and their lifetime.

A session exists from the first `rpc_inference` message to the end of its stream. `SessionRegistry.open`
checks that the session id is free and opens the engine's session; leaving the context closes it whatever
happened (normal end, error, timeout, vanished client): its running steps are cancelled and the engine
frees its cache pages at its next pass. The protocol that runs steps in a session is the inference
service's (server/inference.py); this module only holds a session's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from hivemind.proto import runtime_pb2

from corolla.engine.async_engine import AsyncEngine
from corolla.engine.sequence import EngineSession
from corolla.errors import InvalidRequest, SessionTimeout
from corolla.server.ledger import StepLedger


@dataclass(frozen=True, slots=True)
class Completed:
    """A step of the session has run (or failed): what its one reply carries."""

    step_id: str | None
    run: int  # the ledger's run number of this copy
    outputs: runtime_pb2.Tensor | None = None  # serialized once, for the reply and the push alike
    error: Exception | None = None


@dataclass(eq=False)
class ServerSession:
    session_id: str
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

    @property
    def blocks(self) -> tuple[int, int]:
        return self.start, self.end

    def time_left(self, step_timeout: float) -> float:
        """How long to wait for the next step: the step timeout, cut short by the session's deadline."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise SessionTimeout(f"session {self.session_id} reached the server's session_timeout")
        return min(step_timeout, left)


class SessionRegistry:
    """The open sessions of one engine, by id."""

    def __init__(self, engine: AsyncEngine, session_timeout: float):
        self.engine, self.session_timeout = engine, session_timeout
        self.sessions: dict[str, ServerSession] = {}
        self._claimed: set[str] = set()  # ids in use, including sessions still being opened

    def __len__(self) -> int:
        return len(self.sessions)

    @contextlib.asynccontextmanager
    async def open(  # noqa: PLR0913
        self,
        session_id: str | None,
        blocks: tuple[int, int],
        batch_size: int,
        max_length: int,
        adapter: str | None = None,
        alloc_timeout: float = 0.0,
    ) -> AsyncIterator[ServerSession]:
        session_id = session_id or uuid.uuid4().hex
        if session_id in self._claimed:
            raise InvalidRequest(f"session_id {session_id!r} is already in use on this server")
        self._claimed.add(session_id)
        try:
            engine_session = await self.engine.call(
                lambda: self.engine.engine.open_session(session_id, blocks, batch_size, max_length, adapter)
            )
            now = time.monotonic()
            session = ServerSession(
                session_id,
                self.engine,
                engine_session,
                *blocks,
                batch_size,
                max_length,
                deadline=now + self.session_timeout,
                admit_deadline=now + alloc_timeout,
            )
            self.sessions[session_id] = session
            try:
                yield session
            finally:
                del self.sessions[session_id]
                await _cancel(session.running)
        finally:
            # also when the open itself was cancelled: commands run in order, so this close follows it
            self.engine.close_session(session_id)
            self._claimed.discard(session_id)


async def _cancel(tasks: set[asyncio.Task]) -> None:
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
