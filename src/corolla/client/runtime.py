"""The client's asyncio core behind a synchronous facade, as hivemind's DHT wraps its DHTNode.

One event loop runs in a daemon thread for the lifetime of a client model. Synchronous methods submit
coroutines to it and wait; async callers (an HTTP server, say) can use the coroutines directly on this
loop. Any number of threads may call in at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)
CANCEL_TIMEOUT = 10.0  # how long an interrupted call waits for its cancelled coroutine to end


class LoopThread:
    def __init__(self, name: str = "corolla-client"):
        self.loop = asyncio.new_event_loop()
        self._running = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._running.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._running.set)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for its result from any other thread."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run() called from its own loop; await the coroutine instead")
        if not self.loop.is_running():
            coro.close()
            raise RuntimeError("the client is shut down")
        ended = threading.Event()
        future = asyncio.run_coroutine_threadsafe(_tracked(coro, ended), self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            # Ctrl-C or a timeout here: cancel the coroutine and let it unwind (its finally clauses, the
            # step of an async generator) before the caller goes on, or a caller that then closes what it
            # was using (generate_stream's aclose) would find it still running
            future.cancel()
            _wait_out(ended, CANCEL_TIMEOUT)
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start a coroutine on the loop without waiting (its future's cancel() cancels it)."""
        if not self.loop.is_running():
            coro.close()
            raise RuntimeError("the client is shut down")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop_after(self, started: concurrent.futures.Future[T], close: Callable[[T], Coroutine]) -> None:
        """Stop once `started` (from submit) has ended, closing what it returned: work started alongside
        it failed, and cancelling it could leave running what it started in threads (a DHT peer)."""
        try:
            result = started.result()
        except BaseException:
            logger.debug("The coroutine started alongside failed too", exc_info=True)
        else:
            self.run(close(result))
        self.stop()

    def iterate(self, stream: AsyncIterator[T]) -> Iterator[T]:
        """An async iterator of this loop, iterated from another thread (closed when left)."""
        try:
            while True:
                try:
                    yield self.run(anext(stream))
                except StopAsyncIteration:
                    return
        finally:
            if self.loop.is_running():  # after stop() there is nothing left to close
                try:
                    self.run(stream.aclose())
                except RuntimeError:  # its cancelled step outlived CANCEL_TIMEOUT: it ends on its own
                    logger.debug("A stream's step was still running when it was left", exc_info=True)

    def stop(self) -> None:
        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(_cancel_all_tasks(), self.loop).result(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


def _wait_out(ended: threading.Event, timeout: float) -> None:
    """Wait for `ended` up to `timeout` seconds, through any further Ctrl-C: the first one is on its way up
    already, and a second one must not leave the cancelled coroutine running behind the caller's back."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            ended.wait(max(0.0, deadline - time.monotonic()))
            return
        except KeyboardInterrupt:
            continue


async def _tracked(coro: Coroutine[Any, Any, T], ended: threading.Event) -> T:
    try:
        return await coro
    finally:
        ended.set()


async def _cancel_all_tasks() -> None:
    """Cancel what is still running on the loop (stream readers, say) so that it ends cleanly."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
