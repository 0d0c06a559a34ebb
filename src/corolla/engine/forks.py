"""A session that starts from another session's state (issue 30: conversations that reuse their prefix).

`fork_session` opens a new session whose first `position` positions are those of a session the same
peer holds on this engine: the inputs the engine keeps (what any cache here is rebuilt from) are shared,
and so are the cache pages that hold those positions (reference-counted: whichever session writes into a
shared page first gets a private copy, engine/pages.py). Nothing is sent or computed again. A span whose
layers keep a recurrent state holds it for one position only, so its fork recomputes its state from the
kept inputs on its first step (exact, as after a preemption); so does a fork of a source whose cache was
taken back. A source that is gone, another peer's session, or a position the source does not hold as a
sequence (past its end, or inside a token tree not yet resolved) gets a clear refusal, never wrong state.
"""

from __future__ import annotations

from collections.abc import Sequence

from corolla.engine.pages import pages_for
from corolla.engine.sequence import EngineSession
from corolla.errors import InvalidRequest, SessionNotFound


def fork_session(
    engine,
    source_id: str,
    session_id: str,
    position: int,
    owner: str = "",
    rows: Sequence[int] | None = None,
    max_length: int | None = None,
) -> EngineSession:
    """Open `session_id` continuing row `rows[i]` of `source_id` from `position` (default: every row)."""
    source = engine.sessions.get(source_id)
    if source is None or source.owner != owner:  # another peer's session is none of this one's business
        raise SessionNotFound(f"session {source_id!r} to fork from is gone from this server")
    rows = list(range(source.batch_size)) if rows is None else list(rows)
    _check(source, position, rows)
    length = source.max_length if max_length is None else max_length
    blocks = (source.start, source.end)
    session = engine.open_session(session_id, blocks, len(rows), length, source.adapter, owner)
    if position:  # every row in order: a view of the source's inputs (the engine never writes into them)
        every = rows == list(range(source.batch_size))
        session.inputs = source.inputs[:, :position] if every else source.inputs[rows, :position]
    if source.prompts is not None:  # deep prompts [blocks, B or 1, P, H]
        shared = source.prompts.shape[1] == 1
        session.prompts = source.prompts if shared else source.prompts[:, rows]
    pages = engine.pages
    if not engine.scheduler.state_pages and source.num_cached >= position and source.page_tables:
        keep = pages_for(position, pages.page_size)
        session.page_tables = [[pages.share(page) for page in source.page_tables[r][:keep]] for r in rows]
        session.num_cached = position
    return session


def _check(source: EngineSession, position: int, rows: list[int]) -> None:
    if not rows or any(not 0 <= row < source.batch_size for row in rows):
        raise InvalidRequest(f"fork rows {rows} must name rows 0..{source.batch_size - 1} of the source")
    if not 0 <= position <= source.position:
        raise InvalidRequest(
            f"fork position {position} is outside the source session's 0..{source.position} positions"
        )
    if source.tree is not None and position > source.tree[0]:
        raise InvalidRequest(
            f"fork position {position} is inside the source's token tree (from {source.tree[0]}), "
            "which its next step has not resolved yet"
        )
