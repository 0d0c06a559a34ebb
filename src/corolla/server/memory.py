"""The server's attention-cache budget: reservations that wait, time out, and always come back.

A session reserves the bytes its cache can grow to (batch * max_length tokens of its blocks) before it
runs. When the budget is full it waits, first come first served, up to its `alloc_timeout`, then fails
with `CacheExhausted`. A reservation is released when its context exits, however it exits (normal end,
error, client gone, cancellation), so the budget returns to full when the sessions are gone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from corolla.errors import CacheExhausted


class CacheBudget:
    def __init__(self, total_bytes: int):
        self.total_bytes = total_bytes
        self._used = 0
        self._changed = asyncio.Condition()

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self._used

    @contextlib.asynccontextmanager
    async def reserve(self, nbytes: int, timeout: float, what: str) -> AsyncIterator[None]:
        if nbytes > self.total_bytes:
            raise CacheExhausted(
                f"{what} needs {nbytes} bytes of cache, more than this server's whole budget "
                f"of {self.total_bytes} bytes"
            )
        if nbytes <= self.free_bytes:  # the common case: no waiting, no timer
            self._used += nbytes
        else:
            await self._acquire(nbytes, timeout, what)
        try:
            yield
        finally:
            self._used -= nbytes
            async with self._changed:
                self._changed.notify_all()

    async def _acquire(self, nbytes: int, timeout: float, what: str) -> None:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: nbytes <= self.free_bytes), timeout)
            except (asyncio.TimeoutError, TimeoutError):
                raise CacheExhausted(
                    f"{what} needs {nbytes} bytes of cache but only {self.free_bytes} of {self.total_bytes} "
                    f"were free within alloc_timeout={timeout}s"
                ) from None
            self._used += nbytes
