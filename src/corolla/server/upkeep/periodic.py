"""Work a server repeats in the background (announcements, link measurements, rebalancing).

`Periodic` runs one coroutine function over and over in a task of its own, `delay()` seconds apart; a
failed round is logged and the next round tries again, so a DHT hiccup never stops the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)


class Periodic:
    def __init__(
        self,
        name: str,
        work: Callable[[], Awaitable[Any]],
        delay: Callable[[], float],
        failure: str,
        *,
        at_once: bool = False,  # the first round runs at once, not after a delay
        level: int = logging.WARNING,  # how loudly a failed round is logged
    ):
        self.name = name
        self.work = work
        self.delay = delay
        self.failure = failure
        self.at_once = at_once
        self.level = level
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        if not self.at_once:
            await asyncio.sleep(self.delay())
        while True:
            try:
                await self.work()
            except Exception:  # the next round tries again
                logger.log(self.level, self.failure, exc_info=True)
            await asyncio.sleep(self.delay())
