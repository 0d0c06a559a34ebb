"""A server's speed as its own decode passes show it: what clients route by once it has served.

The figure measured at start (server/hosting/startup_speed.py) is taken in a second or two, on a machine that
may be busy with other servers starting: corolla sim found such figures off by up to 20%, and a session's
first route trusts them (its client has timed nobody yet), which put the p95 of sessions' latency at 1,000
servers at 1.33x the oracle's (1.22x with exact figures). Every decode pass a server runs is a better
measure: its seconds per block, divided by how much slower a batch of its rows is than one sequence (the
batch growth measured at start), is one sequence's step time at the contexts the server really holds. The
median of the latest WINDOW such passes, once there are MIN_PASSES, is announced beside the start-up figure
(ServerStatus.pace): clients route by it and the blocks' keys rank by it (ServerStatus.speed). Placement
keeps weighing the measured figure, which moves only when an idle server measures again (half-hourly:
server/upkeep/speed_check.py): servers decide who moves from one shared view, and weights that changed with
every announcement let two servers move at once. Prefill and tree passes
(more tokens than rows) say nothing of a decode step and are left out.
"""

from __future__ import annotations

import statistics
from collections import deque

from corolla.engine.async_engine import PassTiming

WINDOW = 64  # the latest decode passes the median is taken over
MIN_PASSES = 16  # decode passes seen before there is a pace


class Pace:
    def __init__(self, batch_growth: float = 0.0):
        # as measured at start: a pass of n rows takes 1 + growth * (n - 1) times one row's
        self.batch_growth = batch_growth
        self._seconds: deque[float] = deque(maxlen=WINDOW)  # one sequence's seconds per block, per pass

    def observe(self, timing: PassTiming) -> None:
        """A pass's timing (called on an engine's thread; appending to a deque is atomic)."""
        if timing.rows < 1 or timing.tokens != timing.rows or timing.blocks < 1 or timing.seconds <= 0:
            return
        batch = 1 + self.batch_growth * (timing.rows - 1)
        self._seconds.append(timing.seconds / (timing.blocks * batch))

    def blocks_per_s(self) -> float | None:
        """Blocks per second of one sequence's decode step, as the latest passes ran (None: too few yet)."""
        seconds = list(self._seconds)  # a copy: the engine's thread may append meanwhile
        if len(seconds) < MIN_PASSES:
            return None
        return 1 / statistics.median(seconds)
