"""server/hosting/pace.py: the speed a server announces once its own decode passes have shown it."""

from __future__ import annotations

import dataclasses

import pytest

from corolla.engine.async_engine import PassTiming
from corolla.errors import InvalidRequest
from corolla.server.hosting.pace import MIN_PASSES, WINDOW, Pace
from corolla.wire.records import ServerStatus


def decode(rows: int, blocks: int, seconds: float) -> PassTiming:
    return PassTiming(rows=rows, tokens=rows, blocks=blocks, seconds=seconds)


def test_the_pace_is_one_sequences_step_whatever_the_batch():
    pace = Pace(batch_growth=0.1)
    for rows in range(1, MIN_PASSES + 1):  # 0.01 s per block for one sequence, 10% more per more row
        assert pace.blocks_per_s() is None  # too few passes yet
        pace.observe(decode(rows, 4, 4 * 0.01 * (1 + 0.1 * (rows - 1))))
    assert pace.blocks_per_s() == pytest.approx(100.0)


def test_prefill_and_tree_passes_say_nothing_of_a_decode_step():
    pace = Pace()
    for _ in range(MIN_PASSES):
        pace.observe(PassTiming(rows=2, tokens=256, blocks=3, seconds=9.0))  # a prompt
        pace.observe(PassTiming(rows=1, tokens=8, blocks=3, seconds=9.0))  # a draft tree
        pace.observe(decode(0, 3, 9.0))
        pace.observe(decode(1, 3, 0.0))
    assert pace.blocks_per_s() is None
    for _ in range(MIN_PASSES):
        pace.observe(decode(1, 3, 0.03))
    assert pace.blocks_per_s() == pytest.approx(100.0)


def test_the_latest_passes_decide_and_outliers_do_not():
    pace = Pace()
    for i in range(WINDOW):
        pace.observe(decode(1, 1, 1.0 if i % 8 == 0 else 0.01))  # a pause now and then (a GC, a neighbour)
    assert pace.blocks_per_s() == pytest.approx(100.0)
    for _ in range(WINDOW // 2 + 1):  # the machine slowed down (another job on it): more than half the window
        pace.observe(decode(1, 1, 0.04))
    assert pace.blocks_per_s() == pytest.approx(25.0)


def test_routing_expects_the_pace_and_placement_weighs_the_start_up_figure():
    status = ServerStatus(0, 2, "v", "float32", 64, 0, throughput=42.5)
    assert status.speed == 42.5  # no pace yet: the figure measured at start
    paced = dataclasses.replace(status, pace=200.0)
    assert paced.speed == 200.0 and paced.throughput == 42.5
    assert ServerStatus.from_dict(paced.to_dict()) == paced  # carried by the DHT record and rpc_info
    with pytest.raises(InvalidRequest, match="pace"):
        ServerStatus.from_dict({**paced.to_dict(), "pace": -1.0})
