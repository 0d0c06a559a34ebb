"""The engine's batching policy (engine/batching.py) on a tiny model: which sessions a pass waits for,
and the announcement of the steps a pass completes."""

import time

import torch

from corolla.engine.sequence import ANNOUNCED_GRACE, StepWork
from engine_helpers import make_engine

H = 64


def first_waiting(tiny_models):
    """An engine (a 50 ms window) whose two sessions each ran a step; the first has its next one pending."""
    engine = make_engine(tiny_models["llama"], max_batch_wait_ms=50)
    first, second = (engine.open_session(name, (0, 6), 1, 256) for name in ("first", "second"))
    for session in (first, second):
        engine.add_step(StepWork(session, torch.randn(1, 1, H), 0))
    while engine.has_work():
        engine.step()
    engine.add_step(StepWork(first, torch.randn(1, 1, H), first.position))
    return engine, first, second


def test_a_pass_waits_for_sessions_due_soon_and_for_no_one_else(tiny_models):
    engine = make_engine(tiny_models["llama"], max_batch_wait_ms=50)
    first, second = (engine.open_session(name, (0, 6), 1, 256) for name in ("first", "second"))
    for _ in range(2):  # cycles are measured from the arrivals of each session's steps
        for session in (first, second):
            engine.add_step(StepWork(session, torch.randn(1, 1, H), session.position))
        while engine.has_work():
            engine.step()
    assert engine.pass_seconds > 0 and second.cycle is not None
    engine.add_step(StepWork(first, torch.randn(1, 1, H), first.position))
    now = time.monotonic()
    second.last_arrival, second.cycle = now - 0.190, 0.2  # due in 10 ms
    delay = engine.batch_delay(now)
    assert 0.01 <= delay <= 0.01 + engine.pass_seconds / 4 + 1e-3  # until a little after it is due
    second.last_arrival = now - 0.1  # due in 100 ms: half a cycle away, another group
    assert engine.batch_delay(now) == 0  # is not waited for
    second.last_arrival = now - 0.5  # overdue by more than a cycle: idle
    assert engine.batch_delay(now) == 0
    engine.add_step(StepWork(second, torch.randn(1, 1, H), second.position))
    assert engine.batch_delay(now) == 0  # everyone is here
    engine.step()
    engine.close_session("second")
    engine.add_step(StepWork(first, torch.randn(1, 1, H), first.position))
    assert engine.batch_delay(time.monotonic()) == 0  # a lone session never waits


def test_slow_passes_wait_for_a_group_due_within_two_passes(tiny_models):
    engine, first, second = first_waiting(tiny_models)
    now = time.monotonic()
    second.last_arrival, second.cycle = now - 0.3, 0.4  # due in 100 ms: past max_batch_wait_ms
    engine.pass_seconds = 0.01
    assert engine.batch_delay(now) == 0  # 100 ms is more than 50 ms and two 10 ms passes
    engine.pass_seconds = 0.06  # two passes take 120 ms: the second group costs a pass of its own...
    delay = engine.batch_delay(now)
    assert 0.1 <= delay <= 0.1 + engine.pass_seconds / 4 + 1e-3  # ... so it is waited for
    second.last_arrival = now - 0.2  # due in 200 ms: later than two passes
    assert engine.batch_delay(now) == 0
    engine.pass_seconds = 0.0
    assert make_engine(tiny_models["llama"], max_batch_wait_ms=0).batch_delay(now) == 0  # waits are off


def test_an_announced_step_is_waited_for_until_it_comes_and_cycles_no_longer_count(tiny_models):
    engine, first, second = first_waiting(tiny_models)
    now = time.monotonic()
    engine.pass_seconds = 0.01
    engine.announce("second", now + 0.02)  # the previous server started computing it
    assert 0.02 <= engine.batch_delay(now) <= 0.02 + engine.pass_seconds / 4 + 1e-3
    later = now + 0.03  # late: still on its way (the previous server's pass ran longer), still waited for
    assert 0 < engine.batch_delay(later) <= first.pending[0].arrived_at + 0.05 - later
    assert engine.batch_delay(first.pending[0].arrived_at + 0.05) == 0  # until the window closes
    engine.announce("second", now - ANNOUNCED_GRACE - 0.01)  # long overdue: its previous server failed
    assert engine.batch_delay(now) == 0
    engine.announce("second", now + 0.2)  # further than the window: another group, not waited for
    assert engine.batch_delay(now) == 0
    engine.add_step(StepWork(second, torch.randn(1, 1, H), second.position))
    assert second.announced_at is None  # it came
    while engine.has_work():
        engine.step()
    engine.add_step(StepWork(first, torch.randn(1, 1, H), first.position))
    now = time.monotonic()
    second.last_arrival, second.cycle = now - 0.190, 0.2  # due in 10 ms by its cycle...
    assert engine.batch_delay(now) == 0  # ...but its steps are announced, and this one was not (yet)


def test_a_pass_announces_the_steps_it_completes_as_it_starts(tiny_models):
    engine = make_engine(tiny_models["llama"], max_batch_tokens=8, max_batch_wait_ms=0)
    session = engine.open_session("s", (0, 6), 1, 256)
    heard: list[tuple[int, float]] = []
    work = StepWork(
        session, torch.randn(1, 20, H), 0, announce=lambda s: heard.append((engine.num_passes, s))
    )
    engine.add_step(work)
    while engine.has_work():
        engine.step()
    assert engine.num_passes == 3 and heard == [(2, heard[0][1])]  # 8 + 8 + 4 tokens: as the third starts
    assert heard[0][1] > 0  # the pass time measured so far
    before = engine.pass_seconds
    engine.add_step(StepWork(session, torch.randn(1, 1, H), 20, announce=lambda s: heard.append((-1, s))))
    engine.step()
    assert heard[-1] == (-1, before)
