"""When an idle server measures its speed again (server/upkeep/speed_check.py): only while idle, and a
failed measurement waits a whole period before the next try (tests/integration/test_speed_check.py runs
a real server)."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from corolla.server.upkeep import speed_check
from corolla.server.upkeep.speed_check import SpeedCheck


class Spans:
    """What SpeedCheck reads of the hosted spans: sessions, queued work, passes, and the primary's engine."""

    def __init__(self, fails: bool = False):
        self.is_moving = False
        self.num_sessions = 0
        self.passes = 0
        self.calls = 0

        async def call(fn):
            self.calls += 1
            if fails:
                raise RuntimeError("no room for the measuring engine's cache")
            return "speed"

        self.primary = SimpleNamespace(span=None, engine=SimpleNamespace(call=call))

    def engine_stats(self):
        return [SimpleNamespace(queued_tokens=0, num_passes=self.passes)]


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(speed_check, "QUIET_SECONDS", 0.01)


def test_a_busy_server_tries_again_an_announce_period_later_an_idle_one_a_period_later():
    spans, told = Spans(), []
    check = SpeedCheck(spans, period=1800, announce_period=30, measured=told.append, rng=random.Random(0))
    spans.num_sessions = 1
    assert asyncio.run(check.check()) is None and spans.calls == 0 and 24 <= check._next <= 36
    spans.num_sessions = 0
    assert asyncio.run(check.check()) == "speed" and told == ["speed"] and check._next >= 0.8 * 1800


def test_a_failed_measurement_waits_a_period_not_an_announce_period():
    spans = Spans(fails=True)
    check = SpeedCheck(spans, period=1800, announce_period=30, measured=print, rng=random.Random(0))
    with pytest.raises(RuntimeError):
        asyncio.run(check.check())
    assert spans.calls == 1 and check._next >= 0.8 * 1800


def test_the_first_check_comes_one_to_two_minutes_after_the_start_at_a_random_moment():
    firsts = [SpeedCheck(Spans(), 1800, 30, print, random.Random(seed))._next for seed in range(20)]
    assert all(60 <= first <= 120 for first in firsts) and len(set(firsts)) == 20
    assert SpeedCheck(Spans(), 1, 1, print)._next <= 1  # never later than a period
