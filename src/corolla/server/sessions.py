"""Inference sessions on one server: their caches, positions, deadlines and their registry.

A session exists from the first `rpc_inference` message to the end of its stream. `SessionRegistry.open`
checks the session id is free, reserves cache (waiting up to alloc_timeout), allocates the buffers and
registers the session; leaving the context undoes all of it whatever happened, so a client that errs,
times out or vanishes leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from corolla.errors import InvalidRequest, SessionTimeout
from corolla.models.attention import ContiguousCache
from corolla.models.config import ModelConfig
from corolla.server.memory import CacheBudget


@dataclass
class ServerSession:
    session_id: str
    start: int  # absolute block range this session runs
    end: int
    batch_size: int
    max_length: int
    cache: ContiguousCache
    deadline: float  # monotonic time after which the session is closed
    opened_at: float = field(default_factory=time.monotonic)
    num_steps: int = 0

    @property
    def position(self) -> int:
        return self.cache.position

    def time_left(self, step_timeout: float) -> float:
        """How long to wait for the next step: the step timeout, cut short by the session's deadline."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise SessionTimeout(f"session {self.session_id} reached the server's session_timeout")
        return min(step_timeout, left)


class SessionRegistry:
    def __init__(self, model: ModelConfig, dtype: torch.dtype, budget: CacheBudget, session_timeout: float):
        self.model, self.dtype, self.budget = model, dtype, budget
        self.session_timeout = session_timeout
        self.sessions: dict[str, ServerSession] = {}
        self._reserved_ids: set[str] = set()
        self.bytes_per_token_per_block = model.kv_bytes_per_token_per_block(dtype.itemsize)

    def __len__(self) -> int:
        return len(self.sessions)

    def cache_bytes(self, batch_size: int, max_length: int, num_blocks: int) -> int:
        return batch_size * max_length * num_blocks * self.bytes_per_token_per_block

    @contextlib.asynccontextmanager
    async def open(
        self,
        session_id: str | None,
        blocks: tuple[int, int],
        batch_size: int,
        max_length: int,
        alloc_timeout: float,
    ) -> AsyncIterator[ServerSession]:
        session_id = session_id or uuid.uuid4().hex
        if session_id in self._reserved_ids:
            raise InvalidRequest(f"session_id {session_id!r} is already in use on this server")
        self._reserved_ids.add(session_id)
        try:
            start, end = blocks
            nbytes = self.cache_bytes(batch_size, max_length, end - start)
            what = (
                f"session {session_id} (batch {batch_size} x max_length {max_length}, blocks {start}:{end})"
            )
            async with self.budget.reserve(nbytes, alloc_timeout, what):
                cache = ContiguousCache(
                    end - start,
                    batch_size,
                    self.model.num_key_value_heads,
                    max_length,
                    self.model.head_dim,
                    self.dtype,
                )
                session = ServerSession(
                    session_id,
                    start,
                    end,
                    batch_size,
                    max_length,
                    cache,
                    deadline=time.monotonic() + self.session_timeout,
                )
                self.sessions[session_id] = session
                try:
                    yield session
                finally:
                    # the buffers are freed with the last reference (a step still computing may hold one)
                    del self.sessions[session_id]
        finally:
            self._reserved_ids.discard(session_id)
