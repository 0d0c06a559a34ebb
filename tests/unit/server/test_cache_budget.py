import asyncio

import pytest
import torch

from corolla.errors import CacheExhausted, InvalidRequest
from corolla.models.config import ModelConfig
from corolla.server.memory import CacheBudget
from corolla.server.sessions import SessionRegistry


async def test_reservations_wait_and_time_out():
    budget = CacheBudget(100)
    async with budget.reserve(60, 0, "a"):
        assert budget.free_bytes == 40
        with pytest.raises(CacheExhausted, match="needs 50 bytes of cache but only 40 of 100"):
            async with budget.reserve(50, 0.05, "b"):
                pass

        async def later():
            async with budget.reserve(50, 5, "c"):
                return budget.free_bytes

        waiter = asyncio.create_task(later())
        await asyncio.sleep(0.05)
        assert not waiter.done()
    assert await waiter == 50
    assert budget.free_bytes == 100


async def test_more_than_the_whole_budget_fails_at_once():
    with pytest.raises(CacheExhausted, match="more than this server's whole budget"):
        async with CacheBudget(10).reserve(11, 60, "x"):
            pass


async def test_cancellation_releases_the_reservation():
    budget = CacheBudget(100)
    entered = asyncio.Event()

    async def hold():
        async with budget.reserve(80, 0, "x"):
            entered.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(hold())
    await entered.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert budget.free_bytes == 100


async def test_session_ids_are_unique_and_everything_is_freed(tiny_models):
    config = ModelConfig.from_folder(tiny_models["llama"])
    registry = SessionRegistry(config, torch.float32, CacheBudget(10**7), session_timeout=60)
    async with registry.open("s1", (0, 2), 1, 16, 0) as session:
        assert session.cache.buffer.shape == (2, 2, 1, 2, 16, 16)
        with pytest.raises(InvalidRequest, match="session_id 's1' is already in use"):
            async with registry.open("s1", (0, 2), 1, 16, 0):
                pass
        assert len(registry) == 1
    assert len(registry) == 0 and registry.budget.free_bytes == 10**7
