"""A session's recurrent states (layers that keep one instead of keys and values: models/recurrent.py)
at the positions the engine runs it from.

The keys and values of a position stay in the cache until overwritten, so a rollback only lowers what
counts as cached. A recurrent state holds one position: the engine keeps the state where the session's
current step started (a snapshot: references, since states are never changed in place), and a rollback
or a token tree's kept path goes back to the latest state it has at or before the position it needs,
then recomputes the rest from the inputs the session kept (the same recompute as after a preemption), so
the state is always exactly the one plain decoding would have.

A token tree's step leaves the state at the tree's start (its paths run from there without writing it:
engine/rows.py); the next step keeps a path, which is recomputed from there.
"""

from __future__ import annotations

import torch

from corolla.engine.pages import PageAllocator
from corolla.engine.sequence import Chunk, EngineSession
from corolla.models.span import Span


def state_pages(span: Span, page_size: int) -> int:
    """Cache pages a row holding recurrent states is charged: twice its states (the current ones and a
    step's snapshot), in pages of the span's tokens (a token costs its attention layers' keys and values,
    or, in a span of recurrent layers alone, its hidden state: what the engine keeps of its inputs).
    0 for a span without recurrent layers."""
    if not span.state_blocks:
        return 0
    per_token = span.cache_bytes_per_token or span.config.wire.width * span.dtype.itemsize
    return max(1, -(-2 * span.state_bytes_per_row // (per_token * page_size)))


def uncharged_state_pages(session: EngineSession, per_row: int) -> int:
    """Pages a session must still be charged for its rows' states (0 once charged, or without states)."""
    return 0 if session.state_table else per_row * session.batch_size


def charge_states(pages: PageAllocator, session: EngineSession, per_row: int) -> None:
    """Charge a session for its states, once (released with its pages, on preemption or close)."""
    for _ in range(uncharged_state_pages(session, per_row)):
        session.state_table.append(pages.allocate())


def states_before(chunk: Chunk) -> None:
    """Before a pass: the session's states at the chunk's position (restored from the snapshot, or empty
    at position 0), and a snapshot taken when the chunk starts a step."""
    session = chunk.session
    if len(session.states) != session.batch_size:
        session.states = [{} for _ in range(session.batch_size)]
        session.state_position = 0
    if session.state_position != chunk.position:
        snapshot = session.snapshot
        if snapshot is not None and snapshot[0] == chunk.position:
            session.states = [dict(row) for row in snapshot[1]]
        elif chunk.position == 0:
            session.states = [{} for _ in range(session.batch_size)]
        else:
            raise RuntimeError(
                f"session {session.session_id}: no recurrent state at position {chunk.position} "
                f"(it holds {session.state_position})"
            )
        session.state_position = chunk.position
    if chunk.work is not None and chunk.work.done_tokens == 0:
        session.snapshot = (chunk.position, [dict(row) for row in session.states])


def states_after(chunk: Chunk) -> None:
    """After a pass: the states now hold the chunk's last position (a tree's step leaves them)."""
    if chunk.work is None or chunk.work.tree is None:
        chunk.session.state_position = chunk.position + chunk.num_tokens


def state_floor(session: EngineSession, position: int) -> int:
    """The latest position at or before `position` whose states the engine holds (the current ones, the
    snapshot's, or none at 0): a session rolled back to `position` recomputes from there."""
    if not session.states:
        return position  # no states yet: nothing to restore
    held = [0]
    if session.state_position <= position:
        held.append(session.state_position)
    if session.snapshot is not None and session.snapshot[0] <= position:
        held.append(session.snapshot[0])
    return max(held)


def reorder_states(session: EngineSession, hypo_ids: torch.Tensor) -> None:
    """Beam search: row i continues from row hypo_ids[i], states and snapshot alike."""
    order = hypo_ids.tolist()
    if session.states:
        session.states = [dict(session.states[i]) for i in order]
    if session.snapshot is not None:
        position, rows = session.snapshot
        session.snapshot = (position, [dict(rows[i]) for i in order])
