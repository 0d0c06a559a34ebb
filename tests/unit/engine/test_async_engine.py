"""The asyncio front: streams get results as passes finish, aborts free blocks, errors never hang."""

import asyncio

import pytest
import torch

from corolla.engine.async_engine import AsyncEngine
from corolla.engine.sequence import ForwardWork, StepWork
from corolla.errors import ServerUnavailable
from engine_helpers import assert_close, make_engine, reference_outputs

H = 64


@pytest.fixture
async def engine(tiny_models):
    front = AsyncEngine(make_engine(tiny_models["llama"], max_batch_tokens=8))
    front.start()
    yield front
    await front.stop()


async def open_session(front: AsyncEngine, name: str, batch: int = 1):
    return await front.call(lambda: front.engine.open_session(name, (0, 6), batch, 256))


async def test_concurrent_sessions_stream_their_results(engine):
    plans = {f"s{i}": [torch.randn(1, 3 + i, H)] + [torch.randn(1, 1, H) for _ in range(3)] for i in range(4)}

    async def client(name):
        session, stream, outputs = await open_session(engine, name), engine.stream(), []
        for hidden in plans[name]:
            outputs.append(await engine.run(StepWork(session, hidden, session.position), stream))
        engine.close_session(name)
        return outputs

    results = await asyncio.gather(*(client(name) for name in plans))
    for outputs, plan in zip(results, plans.values(), strict=True):
        for actual, expected in zip(outputs, reference_outputs(engine.engine.span, plan), strict=True):
            assert_close(actual, expected)
    forward = await engine.run(ForwardWork(torch.randn(2, 5, H), (0, 6)))
    assert forward.shape == (2, 5, H)
    await asyncio.sleep(0.05)
    idle_passes = engine.stats.num_passes
    await asyncio.sleep(0.2)
    assert engine.stats.num_passes == idle_passes  # no work, no passes: the loop sleeps
    assert engine.stats.free_cache_tokens == engine.stats.total_cache_tokens


async def test_cancelled_request_is_aborted_and_its_blocks_freed_at_the_next_pass(engine):
    session = await open_session(engine, "long")
    work = StepWork(session, torch.randn(1, 200, H), 0)  # 25 passes of 8 tokens
    task = asyncio.create_task(engine.run(work))
    while engine.stats.num_passes < 2:
        await asyncio.sleep(0.005)
    assert engine.stats.free_cache_tokens < engine.stats.total_cache_tokens
    task.cancel()
    engine.close_session("long")
    await asyncio.gather(task, return_exceptions=True)
    passes_at_abort = engine.stats.num_passes
    for _ in range(100):
        if engine.stats.free_cache_tokens == engine.stats.total_cache_tokens:
            break
        await asyncio.sleep(0.01)
    assert engine.stats.free_cache_tokens == engine.stats.total_cache_tokens
    assert engine.stats.num_passes <= passes_at_abort + 1  # it did not run to its end (25 passes)
    assert engine.stats.num_sessions == 0


async def test_a_failing_pass_reaches_every_waiting_stream_and_the_loop_goes_on(engine):
    runner = engine.engine.runner
    real_run = runner.run
    runner.run = lambda chunks: (_ for _ in ()).throw(RuntimeError("boom"))
    sessions = [await open_session(engine, f"s{i}") for i in range(3)]
    waiting = [engine.run(StepWork(s, torch.randn(1, 2, H), 0)) for s in sessions]
    results = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), timeout=10)
    assert all(isinstance(r, ServerUnavailable) and "RuntimeError: boom" in str(r) for r in results)
    runner.run = real_run
    assert (await engine.run(StepWork(sessions[0], torch.randn(1, 2, H), 0))).shape == (1, 2, H)


async def test_a_command_that_raises_leaves_the_loop_serving(engine):
    """A command's error (a bug) is logged; the engine's thread goes on serving every session."""

    def broken() -> None:
        raise RuntimeError("a bug in a command")

    engine.commands.submit(broken)
    session = await open_session(engine, "after")
    step = StepWork(session, torch.randn(1, 2, H), 0)
    assert (await asyncio.wait_for(engine.run(step), 10)).shape == (1, 2, H)


async def test_stop_fails_what_is_still_waiting(tiny_models):
    front = AsyncEngine(make_engine(tiny_models["llama"], max_cache_tokens=16, page_size=4))
    front.start()
    holder, waiter = await open_session(front, "holder"), await open_session(front, "waiter")
    await front.run(StepWork(holder, torch.randn(1, 16, H), 0))  # the whole pool
    pending = asyncio.create_task(front.run(StepWork(waiter, torch.randn(1, 4, H), 0)))  # waits for memory
    await asyncio.sleep(0.1)
    await front.stop()
    with pytest.raises(ServerUnavailable, match="shutting down"):
        await asyncio.wait_for(pending, timeout=5)
