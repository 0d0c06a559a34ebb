"""An idle server measures its speed again now and then, and announces the new figure.

The figure measured at start (server/hosting/startup_speed.py) is taken in a second or two on a machine
that may be busy: servers started together on one machine, or beside a job that has since ended, keep a
figure several times slower than they are, and placement weighs it for as long as they run (routing has
the pace of their passes once they serve: server/hosting/pace.py; placement and an idle server have only
this figure). So a server that has had no session and run no pass for a while measures again, on its
engine's thread (a step that arrives meanwhile waits for the measurement, a few seconds at most), over the
blocks it holds, and the measurement replaces the old one in its status, its rebalancer and the blocks'
keys. The first check comes a few announce periods (at least two minutes, at most a period) after the
start, at a random moment (servers started together do not measure together again); a busy server tries
again an announce period later. The measuring engine has a small cache of its own (8 sequences of 150-odd
tokens): where the server's pool leaves no room for it (a GPU), the measurement fails, is logged, and is
tried again a period later.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from functools import partial

from corolla.server.hosting.spans import HostedSpans
from corolla.server.hosting.startup_speed import Speed, measure_speed
from corolla.server.upkeep.periodic import Periodic

FIRST_CHECK_PERIODS = 4  # the first check: within this many announce periods of the start,
FIRST_CHECK_SECONDS = 120.0  # or of this many seconds if longer (at most a period, though)
QUIET_SECONDS = 1.0  # no pass in this long (and no session open): idle


class SpeedCheck:
    def __init__(
        self,
        spans: HostedSpans,
        period: float,
        announce_period: float,
        measured: Callable[[Speed], None],
        rng: random.Random | None = None,
    ):
        self.spans = spans
        self.period = period
        self.announce_period = announce_period
        self.measured = measured  # told each new figure
        self._rng = rng or random.Random()
        first = min(period, max(FIRST_CHECK_PERIODS * announce_period, FIRST_CHECK_SECONDS))
        self._next = first * self._rng.uniform(0.5, 1.0)
        self._loop = Periodic("corolla-speed-check", self.check, lambda: self._next, "Measuring speed failed")

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def check(self) -> Speed | None:
        """Measure if the server is idle (the new figure, told to `measured`); else try again later."""
        self._next = self.announce_period * self._rng.uniform(0.8, 1.2)
        if not await self.idle():
            return None
        self._next = self.period * self._rng.uniform(0.8, 1.2)  # a failed measurement too (logged)
        backend = self.spans.primary
        speed = await backend.engine.call(partial(measure_speed, backend.span, use_cache=False))
        if self.spans.primary is not backend:  # moved meanwhile: the figure is for blocks it left
            return None
        self.measured(speed)
        return speed

    async def idle(self) -> bool:
        """No session open, nothing queued, no pass run for QUIET_SECONDS, not moving."""

        def passes() -> int | None:
            if self.spans.is_moving or self.spans.num_sessions:
                return None
            stats = self.spans.engine_stats()
            if any(s.queued_tokens for s in stats):
                return None
            return sum(s.num_passes for s in stats)

        before = passes()
        if before is None:
            return False
        await asyncio.sleep(QUIET_SECONDS)
        return passes() == before
