"""The synchronous engine: sessions and work in, one batched pass per `step()`, completions out.

`step()` reads schedule -> copy and clear cache pages -> run -> postprocess. Nothing here knows about
networking or asyncio; one thread drives it (the async front in async_engine.py), and tests drive it
directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from corolla.config import EngineConfig
from corolla.engine.batching import batch_delay
from corolla.engine.forks import fork_session
from corolla.engine.idle import IdleSessions
from corolla.engine.kv_pool import KVPool
from corolla.engine.model_runner import ModelRunner
from corolla.engine.pages import PageAllocator
from corolla.engine.scheduler import Scheduler
from corolla.engine.sequence import (
    BackwardWork,
    Chunk,
    Completion,
    EngineSession,
    ForwardWork,
    SessionStatus,
    StepWork,
)
from corolla.engine.states import state_pages
from corolla.errors import InvalidRequest, ServerUnavailable
from corolla.models.span import Span


@dataclass(frozen=True)
class EngineStats:
    num_sessions: int
    queued_tokens: int
    free_cache_tokens: int
    total_cache_tokens: int
    num_passes: int = 0
    batched_rows: int = 0  # rows run in the last pass
    total_rows: int = 0  # rows run in all passes (total_rows / num_passes: the mean batch)
    num_idle: int = 0  # ended sessions kept for forks (engine/idle.py), not counted in num_sessions
    forked_tokens: int = 0  # positions sessions started from another's cache instead of computing them
    computed_tokens: int = 0  # positions run through the span, per row


class Engine:
    def __init__(self, span: Span, config: EngineConfig):
        if config.max_cache_tokens is None:
            raise InvalidRequest("the engine needs max_cache_tokens: the size of its attention cache")
        self.span = span
        self.config = config
        num_pages = config.max_cache_tokens // config.page_size
        self.pages = PageAllocator(num_pages, config.page_size)
        self.pool = KVPool(
            {block: span.cache_shapes[block] for block in span.kv_blocks},
            num_pages,
            config.page_size,
            span.dtype,
            span.device,
            aliases=span.kv_sources,
        )
        self.idle = IdleSessions(
            {},  # every session of the engine (the scheduler's), the idle ones among them
            self.close_session,
            config.max_idle_sessions_per_peer,
            max(config.max_sessions // 2, 1),
            config.idle_session_timeout,
        )
        self.scheduler = Scheduler(
            self.pages,
            config.max_batch_tokens,
            config.max_batch_rows,
            self.pool.move_positions,
            self.idle,
            state_pages=state_pages(span, config.page_size),
        )
        self.runner = ModelRunner(span, self.pool)
        self.forked_tokens = 0  # positions sessions started from without computing them (forks)
        self.computed_tokens = 0  # positions run through the span (prefill, decode, recompute), per row
        self.num_passes = 0
        self.batched_rows = 0
        self.batched_tokens = 0  # tokens run in the last pass (equal to its rows: decode steps only)
        self.total_rows = 0
        self.pass_seconds = 0.0  # a moving average of recent passes' duration

    @property
    def sessions(self) -> dict[str, EngineSession]:
        return self.scheduler.sessions

    def stats(self) -> EngineStats:
        size = self.pages.page_size
        return EngineStats(
            len(self.sessions) - len(self.idle),
            self.scheduler.queued_tokens,
            self.pages.num_free * size,
            self.pages.num_pages * size,
            self.num_passes,
            self.batched_rows,
            self.total_rows,
            len(self.idle),
            self.forked_tokens,
            self.computed_tokens,
        )

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def batch_delay(self, now: float) -> float:
        """How long to wait before the next pass so that more sessions' steps join it (0: run now;
        engine/batching.py). Forward requests never wait."""
        if self.scheduler.forwards:
            return 0.0
        config = self.config
        return batch_delay(
            self.sessions.values(),
            self.idle,
            config.max_batch_wait_ms,
            config.max_batch_rows,
            self.pass_seconds,
            now,
        )

    def announce(self, session_id: str, at: float) -> None:
        """The previous server of a session's chain started computing its next step, expected at `at`."""
        session = self.sessions.get(session_id)
        if session is not None and not session.pending:
            session.announce(at)

    # --- sessions and work ---------------------------------------------------------------------------------

    def open_session(
        self,
        session_id: str,
        blocks: tuple[int, int],
        batch_size: int,
        max_length: int,
        adapter: str | None = None,
        owner: str = "",
    ) -> EngineSession:
        if session_id in self.idle:  # its owner reuses the id of a session it ended: a new session
            self.idle.evict(session_id)
        if session_id in self.sessions:
            raise InvalidRequest(f"session_id {session_id!r} is already open on this engine")
        self.span.config.kv_sharing.check_span(*blocks, self.span.config.model_type)
        while len(self.sessions) >= self.config.max_sessions and self.idle.evict_one():
            pass
        if len(self.sessions) >= self.config.max_sessions:
            raise ServerUnavailable(
                f"this server already holds max_sessions={self.config.max_sessions} sessions"
            )
        session = EngineSession(session_id, blocks[0], blocks[1], batch_size, max_length, adapter, owner)
        self.sessions[session_id] = session
        return session

    def fork_session(
        self, source_id: str, session_id: str, position: int, owner: str = "", **options
    ) -> EngineSession:
        """A new session starting from `position` of another session of the same owner (engine/forks.py):
        its positions are shared, not sent or computed again."""
        session = fork_session(self, source_id, session_id, position, owner, **options)
        self.idle.touch(source_id)
        self.forked_tokens += session.num_cached * session.batch_size
        return session

    def keep_session(self, session_id: str) -> bool:
        """Keep an ended session, idle and evictable, for later forks (engine/idle.py); close it if it
        cannot be kept. Whether it was kept."""
        session = self.sessions.get(session_id)
        if session is not None and self.idle.keep(session):
            return True
        self.close_session(session_id)
        return False

    def close_session(self, session_id: str) -> list[Completion]:
        """End a session now: its pages go back to the pool and its pending steps fail."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return []
        self.idle.forget(session_id)
        for table in [*session.page_tables, session.state_table]:
            self.pages.release_all(table)
        error = ServerUnavailable(f"session {session_id} was closed")
        return [Completion(work.request_id, error=error) for work in session.pending]

    def add_step(self, work: StepWork) -> None:
        work.session.arrive(work.arrived_at)
        work.session.pending.append(work)

    def add_forward(self, work: ForwardWork) -> None:
        self.scheduler.forwards.append(work)

    def abort(self, request_id: int) -> bool:
        """Drop a request wherever it is; a step's chunks already run stay in its session's cache."""
        for session in self.sessions.values():
            for work in session.pending:
                if work.request_id == request_id:
                    session.pending.remove(work)
                    return True
        for work in self.scheduler.forwards:
            if work.request_id == request_id:
                self.scheduler.forwards.remove(work)
                return True
        return False

    def pending_request_ids(self) -> list[int]:
        steps = [w.request_id for s in self.sessions.values() for w in s.pending]
        return steps + [w.request_id for w in self.scheduler.forwards]

    # --- one pass ------------------------------------------------------------------------------------------

    def step(self) -> list[Completion]:
        """One pass: schedule -> copy and clear pages -> run -> postprocess; returns what completed."""
        plan = self.scheduler.schedule()
        completions = []
        for work, error in plan.failed:
            work.session.pending.remove(work)
            completions.append(Completion(work.request_id, error=error))
        self.pool.clear_pages(self.pages.take_fresh())
        if plan.copies:
            self.pool.copy_pages(plan.copies)
        if plan.chunks:
            self._announce(plan.chunks)
            started = time.perf_counter()
            outputs = self.runner.run(plan.chunks)
            self.pass_seconds += 0.2 * (time.perf_counter() - started - self.pass_seconds)
            completions += [
                c
                for chunk, out in zip(plan.chunks, outputs, strict=True)
                if (c := self._postprocess(chunk, out)) is not None
            ]
            self.num_passes += 1
            self.batched_rows = sum(chunk.num_rows for chunk in plan.chunks)
            self.batched_tokens = sum(chunk.num_rows * chunk.num_tokens for chunk in plan.chunks)
            self.total_rows += self.batched_rows
        if plan.forward is not None and (done := self._forward_slice(plan.forward)) is not None:
            completions.append(done)
        return completions

    def _announce(self, chunks: list[Chunk]) -> None:
        """Tell the steps this pass completes that it starts (a server pushing them on announces them to
        the next server: engine/batching.py)."""
        for chunk in chunks:
            work = chunk.work
            if work is not None and work.announce is not None and chunk.num_tokens == work.remaining:
                work.announce(self.pass_seconds)

    def _forward_slice(self, work: ForwardWork) -> Completion | None:
        """Run the next rows of a forward or backward request (at most forward_slice_tokens tokens, so an
        inference step never waits long behind training work); the completion once every row is done."""
        rows = max(1, self.config.forward_slice_tokens // work.hidden.shape[1])
        end = min(work.done_rows + rows, work.hidden.shape[0])
        part = work.rows(work.done_rows, end)
        run = self.runner.backward if isinstance(part, BackwardWork) else self.runner.forward
        work.results.append(run(part))
        work.done_rows = end
        if end < work.hidden.shape[0]:
            self.scheduler.forwards.appendleft(work)  # the rest goes on at its next turn
            return None
        return Completion(work.request_id, work.result())

    def _postprocess(self, chunk: Chunk, outputs: torch.Tensor) -> Completion | None:
        session = chunk.session
        work = chunk.work
        session.num_cached = chunk.position + chunk.num_tokens
        self.computed_tokens += chunk.num_rows * chunk.num_tokens
        if work is None:  # a recompute chunk: the cache is rebuilt up to num_cached, outputs are not needed
            if not session.needs_recompute:
                session.status = SessionStatus.RUNNING
            return None
        session.append_inputs(work.hidden[:, work.done_tokens : work.done_tokens + chunk.num_tokens])
        work.done_tokens += chunk.num_tokens
        work.outputs.append(outputs.to(work.hidden.device, work.hidden.dtype))  # off the span's device
        if work.remaining:
            return None
        session.pending.popleft()
        session.last_step_at = time.monotonic()
        result = work.outputs[0] if len(work.outputs) == 1 else torch.cat(work.outputs, dim=1)
        return Completion(work.request_id, result)
