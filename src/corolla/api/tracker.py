"""The API server's request tracker: one async stream per request, fed by a job on the model's loop.

The HTTP server runs on its own event loop; the swarm client runs on the model's loop (another thread).
`RequestTracker.add` starts a request's job (an async iterator of outputs) on the model's loop and
returns a `RequestStream` on the API's loop that yields the job's outputs as they come. `abort` (a client
disconnected, or the server stops) cancels the job where it runs: the generation's `finally` closes its
inference session on every server of the chain at once, so their caches are freed without waiting for
timeouts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

logger = logging.getLogger(__name__)

_END = object()


class RequestStream:
    """Outputs of one request, in order; raises the job's error, if any, after the last output."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: asyncio.Queue = asyncio.Queue()
        self.job_ended = False  # the job has delivered its last output (or its error)
        self.finished = False  # and the reader has reached it

    def put(self, item: Any) -> None:
        self._queue.put_nowait(item)

    def finish(self, error: BaseException | None = None) -> None:
        self.job_ended = True
        self._queue.put_nowait(error if error is not None else _END)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Any:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        return item


class RequestTracker:
    def __init__(self, model_loop: asyncio.AbstractEventLoop):
        self.model_loop = model_loop
        self._jobs: dict[str, tuple[concurrent.futures.Future, RequestStream]] = {}

    @property
    def num_active(self) -> int:
        return len(self._jobs)

    def add(self, request_id: str, job: Callable[[], AsyncIterator[Any]]) -> RequestStream:
        """Start `job()` on the model's loop; its outputs arrive in the returned stream (on this loop)."""
        if request_id in self._jobs:
            raise KeyError(f"request {request_id} is already running")
        api_loop = asyncio.get_running_loop()
        stream = RequestStream(request_id)

        async def pump() -> None:
            try:
                async for item in job():
                    api_loop.call_soon_threadsafe(stream.put, item)
            except asyncio.CancelledError:
                api_loop.call_soon_threadsafe(self._ended, request_id, stream, asyncio.CancelledError())
                raise
            except Exception as e:  # delivered to the request's handler, which maps it to an HTTP error
                api_loop.call_soon_threadsafe(self._ended, request_id, stream, e)
            else:
                api_loop.call_soon_threadsafe(self._ended, request_id, stream, None)

        future = asyncio.run_coroutine_threadsafe(pump(), self.model_loop)
        self._jobs[request_id] = future, stream
        future.add_done_callback(lambda _: api_loop.call_soon_threadsafe(self._cancelled, request_id, stream))
        return stream

    def _cancelled(self, request_id: str, stream: RequestStream) -> None:
        """A job cancelled before it started never reached pump's handlers: end its stream here."""
        if not stream.job_ended:
            self._ended(request_id, stream, asyncio.CancelledError())

    def _ended(self, request_id: str, stream: RequestStream, error: BaseException | None) -> None:
        """On the API's loop: the job is no longer active by the time its reader sees the end."""
        self._jobs.pop(request_id, None)
        stream.finish(error)

    def abort(self, request_id: str) -> bool:
        """Cancel a request's job (its sessions close on every server); False if it already ended."""
        future, stream = self._jobs.get(request_id, (None, None))
        if future is None or future.done() or stream.job_ended:
            return False
        logger.info("Aborting request %s", request_id)
        future.cancel()
        return True

    def abort_all(self) -> None:
        for request_id in list(self._jobs):
            self.abort(request_id)
