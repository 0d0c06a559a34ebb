"""Async streams of the API layer: merging concurrent generations, a whole answer's settled steps, and a
response's event stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from corolla.decoding.chooser import GenerationStep

Indexed = tuple[int, GenerationStep]  # a prompt's index and a step of its generation


class EventStream:
    """A streaming answer: the SSE events, and what to call when the response ends, however it ends."""

    def __init__(
        self,
        events: AsyncIterator[str],
        on_close: Callable[[], Awaitable[None]],
        media_type: str = "text/event-stream",
    ):
        self.events = events
        self.on_close = on_close
        self.media_type = media_type  # SSE, or JSON lines (Ollama's API)

    def __aiter__(self) -> AsyncIterator[str]:
        return self.events

    async def aclose(self) -> None:
        try:
            await self.events.aclose()
        finally:
            await self.on_close()


async def merge(iterators: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """Items of several async iterators as they come; closing this closes (and cancels) them all."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(iterator: AsyncIterator[Any]) -> None:
        try:
            async for item in iterator:
                await queue.put(item)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(drain(it)) for it in iterators]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
                for task in tasks:
                    if task.done() and task.exception() is not None:
                        raise task.exception()
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def settled(steps: AsyncIterator[Indexed]) -> AsyncIterator[Indexed]:
    """A whole answer's steps once its generations are over, without those a spot check withdrew (their
    tokens were chosen again by the steps that follow)."""
    kept: list[Indexed] = []
    async for prompt_index, step in steps:
        if not step.withdrawn:
            kept.append((prompt_index, step))
            continue
        mine = [i for i, (index, _) in enumerate(kept) if index == prompt_index]
        for i in reversed(mine[len(mine) - step.withdrawn :]):
            del kept[i]
    for item in kept:
        yield item
