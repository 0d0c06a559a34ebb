"""Sessions kept after their stream ended, idle, for later forks (issue 30: reused prefixes).

A client that asked to keep a session (`keep` in its first message) may start new sessions from it later
(engine/forks.py) instead of sending its positions again. Such a session holds its cache pages and kept
inputs while idle, so it must never cost anyone else anything: it is the first thing taken back whenever
pages or session slots run short (least recently used first, before any working session is preempted or
any new one waits), it counts against its owner's share of the cache like any of its sessions, and there
are at most `max_per_owner` per peer and `max_total` in all (the oldest go first), each for at most
`timeout` seconds (checked whenever one is kept or evicted). A fork of an evicted session finds it
gone: a clear refusal, never wrong state.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from corolla.engine.sequence import EngineSession


class IdleSessions:
    def __init__(
        self,
        sessions: dict[str, EngineSession],
        close: Callable[[str], object],
        max_per_owner: int = 16,
        max_total: int = 256,
        timeout: float = 600.0,
    ):
        self.sessions = sessions  # the engine's sessions: an idle one stays among them
        self.close = close  # the engine's: a session closed, its pages given back
        self.max_per_owner = max_per_owner
        self.max_total = max_total
        self.timeout = timeout
        self._since: OrderedDict[str, float] = OrderedDict()  # session id -> idle since, oldest first
        self.num_evicted = 0

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._since

    def __len__(self) -> int:
        return len(self._since)

    def keep(self, session: EngineSession) -> bool:
        """Keep an ended session for forks (up to its token tree, if its last step was one: forks.py);
        False (the caller closes it) if none may be kept."""
        self.expire()
        if session.pending or not self.max_per_owner or not self.max_total:
            return False
        self._since[session.session_id] = time.monotonic()
        owned = [sid for sid in self._since if self.sessions[sid].owner == session.owner]
        for sid in owned[: max(0, len(owned) - self.max_per_owner)]:
            self.evict(sid)
        while len(self._since) > self.max_total:
            self.evict_one()
        return True

    def touch(self, session_id: str) -> None:
        """A fork read it: it is the most recently used."""
        if session_id in self._since:
            self._since[session_id] = time.monotonic()
            self._since.move_to_end(session_id)

    def forget(self, session_id: str) -> None:
        """It was closed by other means."""
        self._since.pop(session_id, None)

    def expire(self) -> None:
        deadline = time.monotonic() - self.timeout
        for sid in [sid for sid, since in self._since.items() if since < deadline]:
            self.evict(sid)

    def evict_one(self) -> bool:
        """Close the least recently used idle session; False if there is none."""
        self.expire()
        if not self._since:
            return False
        self.evict(next(iter(self._since)))
        return True

    def evict(self, session_id: str) -> None:
        self._since.pop(session_id)
        self.close(session_id)
        self.num_evicted += 1
