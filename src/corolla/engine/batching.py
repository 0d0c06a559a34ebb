"""When a pass should start: the engine's batching policy (a pure function of its sessions and the clock).

Sessions cycle through a chain of servers and the client, so their steps reach a server spread out in
time; running each pass at once gives many small passes, and on a CPU a pass of 16 rows costs little more
than a pass of 4 (each pass reads the span's weights whatever its rows). So a pass waits for the sessions
whose next step is due within a window of its oldest step, until a little after the last of them is due.

When a step is due: a session whose steps are pushed here by the previous server of its chain is told in
advance (`EngineSession.announce`: that server started the pass computing the step, and pushes its
outputs in about one pass), and is waited for only then, until it arrives or the window closes; the other
sessions (the first server of a chain, a previous server that does not announce) are expected a cycle (a
moving average of the time between their steps' arrivals) after their last step. Announcements are what
merges groups: a group waits only for steps that are being computed, never for a group that is itself
waiting somewhere else, so two groups no longer each wait their whole window for the other at every
server, and once merged they run in step, one pass per cycle. Sessions due later, or long overdue
(idle), are not waited for, and a lone session never waits.

The window is max_batch_wait_ms, or PASSES_WORTH_WAITING passes when passes take longer: a group due
before this pass and the next would have run anyway costs one pass instead of two. 16 sessions through
3 CPU servers on one 2-core machine, back to back, before announcements: a fixed 50 ms window kept them in
groups of about 4 (4.0 rows a pass of ~33 ms, 37.7 tokens/s, both cores 92% busy); two passes' window,
8.5 rows a pass, 41.8 tokens/s at 70% busy: 1.11x the tokens for 0.71x the CPU per token.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from corolla.engine.sequence import EngineSession, SessionStatus

# a pass waits for sessions due within this many passes' time (or max_batch_wait_ms, if longer)
PASSES_WORTH_WAITING = 2.0


def batch_delay(
    sessions: Iterable[EngineSession],
    idle: Container[str],
    max_wait_ms: float,
    max_rows: int,
    pass_seconds: float,
    now: float,
) -> float:
    """Seconds to wait before the next pass so that more sessions' steps join it (0: run now)."""
    max_wait = max_wait_ms / 1000
    if max_wait <= 0:
        return 0.0
    max_wait = max(max_wait, PASSES_WORTH_WAITING * pass_seconds)
    sessions = [s for s in sessions if s.session_id not in idle]
    pending = [s for s in sessions if s.pending]
    if not pending or any(s.status != SessionStatus.RUNNING for s in pending):
        return 0.0
    if sum(s.batch_size for s in pending) >= max_rows:
        return 0.0
    oldest = min(s.pending[0].arrived_at for s in pending)
    due = [s.due_at(now) for s in sessions if not s.pending]
    due = [t for t in due if t is not None and t <= oldest + max_wait]
    if not due:
        return 0.0
    return max(0.0, min(max(due) + pass_seconds / 4, oldest + max_wait) - now)
