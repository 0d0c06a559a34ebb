"""Inference sessions on one server: ids, positions, deadlines, and their engine sessions.

A session exists from the first `rpc_inference` message to the end of its stream. `SessionRegistry.open`
checks that the session id is free and opens the engine's session; leaving the context closes it whatever
happened (normal end, error, timeout, vanished client), and the engine frees its cache blocks at its next
pass. Cache memory is not reserved here: the engine allocates blocks as the session grows.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

from hivemind.proto import runtime_pb2

from corolla.engine.async_engine import AsyncEngine, RequestStream
from corolla.engine.sequence import EngineSession
from corolla.errors import InvalidRequest, ServerUnavailable, SessionTimeout

REMEMBERED_STEPS = 8


@dataclass
class ServerSession:
    session_id: str
    engine: AsyncEngine
    engine_session: EngineSession
    stream: RequestStream  # the results of all this session's steps
    start: int  # absolute block range this session runs
    end: int
    batch_size: int
    max_length: int
    deadline: float  # monotonic time after which the session is closed
    position: int = 0  # tokens received so far (the client's view; the engine keeps its own)
    num_steps: int = 0
    # the latest steps by step_id: a step arriving twice (pushed, and from the client) runs once
    results: OrderedDict[str, asyncio.Future] = field(default_factory=OrderedDict)
    # outputs of pushed steps, for the client as soon as they exist; and the steps already replied to
    pushed: asyncio.Queue[tuple[str, runtime_pb2.Tensor]] = field(default_factory=asyncio.Queue)
    replied: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def remember(self, step_id: str | None) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if step_id:
            self.results[step_id] = future
            while len(self.results) > REMEMBERED_STEPS:
                self.results.popitem(last=False)
        return future

    def first_reply(self, step_id: str | None) -> bool:
        """Whether the client still needs this step's outputs (each step gets one reply)."""
        if not step_id:
            return True
        if step_id in self.replied:
            return False
        self.replied[step_id] = None
        while len(self.replied) > REMEMBERED_STEPS:
            self.replied.popitem(last=False)
        return True

    def forget(self, step_id: str | None, future: asyncio.Future, error: BaseException) -> None:
        """A failed step is not remembered, so that another copy of it may still run."""
        if step_id and self.results.get(step_id) is future:
            del self.results[step_id]
        if not future.done():
            future.set_exception(
                error if isinstance(error, Exception) else ServerUnavailable("step cancelled")
            )
            future.exception()  # marks it retrieved: nobody may be waiting

    def time_left(self, step_timeout: float) -> float:
        """How long to wait for the next step: the step timeout, cut short by the session's deadline."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise SessionTimeout(f"session {self.session_id} reached the server's session_timeout")
        return min(step_timeout, left)


class SessionRegistry:
    def __init__(self, engine: AsyncEngine, session_timeout: float):
        self.engine, self.session_timeout = engine, session_timeout
        self.sessions: dict[str, ServerSession] = {}
        self._claimed: set[str] = set()  # ids in use, including sessions still being opened

    def __len__(self) -> int:
        return len(self.sessions)

    @contextlib.asynccontextmanager
    async def open(
        self,
        session_id: str | None,
        blocks: tuple[int, int],
        batch_size: int,
        max_length: int,
        adapter: str | None = None,
    ) -> AsyncIterator[ServerSession]:
        session_id = session_id or uuid.uuid4().hex
        if session_id in self._claimed:
            raise InvalidRequest(f"session_id {session_id!r} is already in use on this server")
        self._claimed.add(session_id)
        try:
            opener = partial(
                self.engine.engine.open_session, session_id, blocks, batch_size, max_length, adapter
            )
            engine_session = await self.engine.call(opener)
            session = ServerSession(
                session_id,
                self.engine,
                engine_session,
                self.engine.stream(),
                blocks[0],
                blocks[1],
                batch_size,
                max_length,
                time.monotonic() + self.session_timeout,
            )
            self.sessions[session_id] = session
            try:
                yield session
            finally:
                del self.sessions[session_id]
        finally:
            # also when the open itself was cancelled: commands run in order, so this close follows it
            self.engine.close_session(session_id)
            self._claimed.discard(session_id)
