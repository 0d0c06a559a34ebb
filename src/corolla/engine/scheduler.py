"""Which work runs in the next pass: decode steps and prefill chunks under a token budget.

Each pass packs at most `max_batch_tokens` tokens and `max_batch_rows` rows, all for the same block range.
Order: steps of sessions that hold their cache (oldest step first), then preempted sessions rebuilding
theirs, then new sessions waiting for admission. A step longer than what is left of the budget runs in
chunks over several passes, so a long prompt never stalls everyone's decoding for its whole length.

Memory: cache pages are allocated as positions are written. A new session waits for free pages up to its
admission deadline (alloc_timeout), then fails with CacheExhausted. A session that holds its cache and
cannot grow takes pages from the most recently admitted other session (preemption); the victim keeps its
inputs and recomputes its cache when pages are free again, so no session fails or gets wrong outputs
because others grew. Ended sessions kept for forks (engine/idle.py) are closed before anyone is preempted
or waits; then idle sessions (no step pending) are taken from first. Forward requests run only when no
inference work can, or after waiting a few passes.

Fair share between peers (a session's `owner`): the cache is shared equally between the peers that hold
or ask for it, and turns are taken in rotation between peers. A peer within its share may take cache
from the longest-idle sessions of peers over theirs, even for a new session (the victims are preempted
and recompute later, so they lose time, never tokens); a peer over its share makes room only from its
own sessions. One peer opening many sessions thus fills the cache only while no one else needs it.

Admission, preemption and fair share are one policy, kept in one class (hence over 300 lines).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from corolla.engine.idle import IdleSessions
from corolla.engine.pages import PageAllocator
from corolla.engine.sequence import Chunk, EngineSession, ForwardWork, SessionStatus, StepWork
from corolla.engine.states import charge_states, reorder_states, state_floor, uncharged_state_pages
from corolla.errors import CacheExhausted, ServerUnavailable

FORWARD_MAX_SKIPS = 4  # a forward request waits at most this many inference passes


@dataclass
class Plan:
    chunks: list[Chunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) pages to copy first
    forward: ForwardWork | None = None
    failed: list[tuple[StepWork, Exception]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and self.forward is None and not self.failed


MoveKV = Callable[[list[int], list[int], list[int]], None]  # (row's page table, from positions, to positions)


class Scheduler:
    def __init__(
        self,
        pages: PageAllocator,
        max_batch_tokens: int,
        max_batch_rows: int,
        move_kv: MoveKV,
        idle: IdleSessions,
        state_pages: int = 0,
    ):
        self.pages = pages
        # > 0: the span has layers with recurrent states, and each row holding them is charged this many
        # pages (engine/states.py)
        self.state_pages = state_pages
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_rows = max_batch_rows
        self.move_kv = move_kv  # copies cached keys and values within a row (keeping a tree's path)
        self.idle = idle  # ended sessions kept for forks: the first closed when pages run short
        self.sessions: dict[str, EngineSession] = idle.sessions  # every session, the idle ones among them
        self.forwards: deque[ForwardWork] = deque()
        self._admissions = itertools.count()
        self._forward_skips = 0

    @property
    def queued_tokens(self) -> int:
        steps = sum(w.remaining * s.batch_size for s in self.sessions.values() for w in s.pending)
        return steps + sum(f.hidden.shape[0] * f.hidden.shape[1] for f in self.forwards)

    def has_work(self) -> bool:
        return bool(self.forwards) or any(s.pending for s in self.sessions.values())

    def schedule(self) -> Plan:
        plan = Plan()
        if self.forwards and self._forward_skips >= FORWARD_MAX_SKIPS:  # a starved forward takes this pass
            plan.forward = self.forwards.popleft()
            self._forward_skips = 0
            return plan
        self._schedule_steps(plan, time.monotonic())
        if self.forwards and plan.chunks:
            self._forward_skips += 1
        elif self.forwards:
            plan.forward = self.forwards.popleft()
            self._forward_skips = 0
        return plan

    def _candidates(self) -> list[StepWork]:
        """Sessions' next steps in the order they get into a pass: by status, then in rotation between
        peers (each peer's k-th step before anyone's k+1-th), then oldest first."""
        rank = {SessionStatus.RUNNING: 0, SessionStatus.PREEMPTED: 1, SessionStatus.WAITING: 2}
        heads = sorted(
            (s.pending[0] for s in self.sessions.values() if s.pending),
            key=lambda w: (rank[w.session.status], w.session.admitted_order, w.arrived_at),
        )
        turns: Counter[tuple[str, int]] = Counter()
        order = {}
        for work in heads:
            key = (work.session.owner, rank[work.session.status])
            order[work.request_id] = (key[1], turns[key])
            turns[key] += 1
        return sorted(heads, key=lambda w: order[w.request_id])

    def _schedule_steps(self, plan: Plan, now: float) -> None:
        tokens = self.max_batch_tokens
        rows = self.max_batch_rows
        block_range = None
        for work in self._candidates():
            session = work.session
            if block_range not in (None, (session.start, session.end)) or session.batch_size > rows:
                continue
            if not work.started and (error := self._start(work)) is not None:
                plan.failed.append((work, error))
                continue
            position = session.num_cached
            goal = session.position if session.needs_recompute else session.position + work.remaining
            length = min(goal - position, tokens // session.batch_size)
            if length <= 0:
                continue
            if work.tree is not None and not session.needs_recompute and length < work.remaining:
                continue  # a token tree runs whole, in a pass of its own if need be
            if not self._reserve(session, position, position + length, plan):
                if self._never_fits(session, session.position + work.remaining):
                    plan.failed.append((work, self._exhausted(work, ever=True)))
                elif session.status == SessionStatus.WAITING and now > work.admit_deadline:
                    plan.failed.append((work, self._exhausted(work)))
                continue
            if session.status == SessionStatus.WAITING:
                session.status = SessionStatus.RUNNING
                session.admitted_order = next(self._admissions)
            chunk_work = None if session.needs_recompute else work
            plan.chunks.append(Chunk(session, chunk_work, position, length))
            tokens -= length * session.batch_size
            rows -= session.batch_size
            block_range = (session.start, session.end)

    def _start(self, work: StepWork) -> Exception | None:
        """Apply a step's rollback and beam reordering before its first chunk.

        The step's position is absolute: an earlier one rolls the session back to it. A later one means an
        earlier step of the session never ran here (it failed), so this one cannot run either.
        """
        session = work.session
        work.started = True
        if work.position > session.position:
            return ServerUnavailable(
                f"session {session.session_id}: a step at position {work.position} follows an earlier step "
                f"that failed (the cache holds {session.position} positions)"
            )
        if not session.page_tables:
            session.page_tables = [[] for _ in range(session.batch_size)]
        self._keep_tree_path(session, work)
        self._roll_back(session, work.position)
        if work.hypo_ids is not None:
            session.page_tables = self.pages.fork(session.page_tables, work.hypo_ids.tolist())
            reorder_states(session, work.hypo_ids)
            if session.inputs is not None:
                session.inputs = session.inputs[work.hypo_ids]
        if work.prompts is not None:
            session.prompts = work.prompts
        if work.tree is not None:
            session.tree = (work.position, work.tree)
        return None

    def _roll_back(self, session: EngineSession, position: int) -> None:
        """Drop the positions from `position` on; a span with recurrent states goes back further, to the
        latest state it holds, and recomputes from there (engine/states.py)."""
        if position < session.position:
            session.inputs = session.inputs[:, :position]
            session.num_cached = min(session.num_cached, position)
        if self.state_pages:
            session.num_cached = state_floor(session, session.num_cached)
        for table in session.page_tables:
            self.pages.truncate(table, session.num_cached)

    def _keep_tree_path(self, session: EngineSession, work: StepWork) -> None:
        """The step after a tree step: keep the tree's accepted path (`work.accepted`, or its first tokens
        up to the step's position when none is named), moved to the positions right after the tree's
        start; its other tokens are dropped with their cache pages. The caller has checked the path."""
        if session.tree is None:
            return
        (start, tree) = session.tree
        session.tree = None
        if work.position <= start:
            return  # rolled back to before the tree: the rollback drops all of it
        nodes = list(work.accepted) if work.accepted is not None else list(range(work.position - start))
        assert tree.is_path(nodes) and start + len(nodes) == work.position, (tree, nodes, work.position)
        kept = range(start, work.position)
        if session.num_cached >= start + len(tree):
            for table in session.page_tables:
                self.move_kv(table, [start + node for node in nodes], list(kept))
            session.num_cached = work.position
        else:  # preempted since: the path is recomputed from the inputs kept below
            session.num_cached = min(session.num_cached, start)
        path = start + torch.tensor(nodes, dtype=torch.long)
        session.inputs = torch.cat([session.inputs[:, :start], session.inputs[:, path]], dim=1)
        for table in session.page_tables:
            self.pages.truncate(table, session.num_cached)

    def _reserve(self, session: EngineSession, start: int, end: int, plan: Plan) -> bool:
        """Allocate pages for positions [start, end) of every row, preempting others if needed.

        A new session is admitted only if its whole first step fits in free pages, or in pages it may take
        from peers over their share; a session already admitted may also take pages from idle or younger
        sessions.
        """
        needed = sum(self.pages.pages_needed(table, start, end) for table in session.page_tables)
        needed += uncharged_state_pages(session, self.state_pages)
        in_pass = {chunk.session for chunk in plan.chunks} | {session}
        if session.status == SessionStatus.WAITING:
            whole = sum(
                self.pages.pages_needed(t, 0, start + session.pending[0].remaining)
                for t in session.page_tables
            ) + uncharged_state_pages(session, self.state_pages)
            while not self.pages.can_allocate(whole) and (
                self.idle.evict_one() or self._preempt_one(in_pass, session, whole, fair_only=True)
            ):
                pass
            return self.pages.can_allocate(whole) and self._allocate(session, start, end, needed, plan)
        while not self.pages.can_allocate(needed) and (
            self.idle.evict_one() or self._preempt_one(in_pass, session, needed)
        ):
            pass
        return self._allocate(session, start, end, needed, plan)

    def _allocate(self, session: EngineSession, start: int, end: int, needed: int, plan: Plan) -> bool:
        if not self.pages.can_allocate(needed):
            return False
        for table in session.page_tables:
            plan.copies.extend(self.pages.prepare_write(table, start, end))
        charge_states(self.pages, session, self.state_pages)
        return True

    def _preempt_one(
        self, exclude: set[EngineSession], asking: EngineSession, needed: int, fair_only: bool = False
    ) -> bool:
        """Free the cache pages of one session for `asking`, which needs `needed` more pages.

        First choice: the longest-idle session of a peer over its share (unless `asking`'s own peer would
        be over its share: then only its own sessions). Otherwise, unless `fair_only` (a new session takes
        nothing else): an idle session, else the most recently admitted busy one that came after
        `asking`, so the oldest session with work can always proceed.
        """
        held = self._pages_by_owner()
        share = self.pages.num_pages / len(held.keys() | {asking.owner})
        holding = [s for s in self.sessions.values() if s not in exclude and any(s.page_tables)]
        if held[asking.owner] + needed > share:
            holding = [s for s in holding if s.owner == asking.owner]
        over = [s for s in holding if held[s.owner] > share and not s.pending and s.owner != asking.owner]
        if over:
            victim = min(over, key=lambda s: s.last_step_at)
        elif fair_only:
            return False
        else:
            victims = [s for s in holding if not s.pending or s.admitted_order > asking.admitted_order]
            if not victims:
                return False
            victim = min(victims, key=lambda s: (bool(s.pending), -s.admitted_order))
        for table in [*victim.page_tables, victim.state_table]:
            self.pages.release_all(table)
        victim.num_cached = 0
        victim.drop_states()
        victim.status = SessionStatus.PREEMPTED
        return True

    def _pages_by_owner(self) -> Counter[str]:
        held: Counter[str] = Counter()
        for session in self.sessions.values():
            held[session.owner] += sum(len(t) for t in session.page_tables) + len(session.state_table)
        return held

    def _never_fits(self, session: EngineSession, end: int) -> bool:
        per_row = -(-end // self.pages.page_size) + self.state_pages
        return per_row * session.batch_size > self.pages.num_pages

    def _exhausted(self, work: StepWork, ever: bool = False) -> CacheExhausted:
        session = work.session
        # a row's recurrent states count as the tokens of the pages they are charged
        need = session.batch_size * (
            session.position + work.remaining + self.state_pages * self.pages.page_size
        )
        size = self.pages.num_pages * self.pages.page_size
        if ever:
            return CacheExhausted(
                f"session {session.session_id} needs {need} tokens of cache, more than this "
                f"server's whole cache of {size} tokens"
            )
        free = self.pages.num_free * self.pages.page_size
        return CacheExhausted(
            f"session {session.session_id} could not get cache for {need} tokens within "
            f"alloc_timeout (free: {free} of {size} tokens)"
        )
