"""The engine's asyncio front: a command queue, a result stream per request, and a background loop thread.

Services (on the server's event loop) open sessions and submit work; each request's results arrive in
a `ResultStream` as soon as the loop thread delivers them. The loop thread runs engine passes while
there is work and sleeps when there is none. Commands (new work, aborts, session closes) reach it through
the `CommandQueue`, in the order they were sent, and take effect at the start of the next pass, so an
aborted request or a closed session leaves the running batch and frees its cache pages at once. If a
pass raises, the error reaches every request in flight, never a hang, and the loop keeps serving new work.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from corolla.engine.engine import Engine, EngineStats
from corolla.engine.sequence import Completion, ForwardWork, Gradients, StepWork
from corolla.errors import CorollaError, ServerUnavailable
from corolla.models.devices import enter_device

logger = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.02  # while work waits for memory, re-check admission deadlines this often


@dataclass(frozen=True)
class PassTiming:
    """One engine pass as its listeners see it."""

    rows: int  # sequences in it
    tokens: int  # positions it computed (== rows: every row a decode step)
    blocks: int  # of the span it ran
    seconds: float  # from scheduling to the results


class StepDropped(CorollaError):
    """A queued step was dropped before it ran (AsyncEngine.drop)."""


class ResultStream:
    """Results of one request, in order; `next()` waits for the next one or raises its error."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue[Completion] = asyncio.Queue()

    def deliver(self, completion: Completion) -> None:
        """From any thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, completion)

    def put(self, completion: Completion) -> None:
        """From the event loop's own thread."""
        self._queue.put_nowait(completion)

    async def next(self) -> torch.Tensor | Gradients:
        completion = await self._queue.get()
        if completion.error is not None:
            raise completion.error
        return completion.outputs


class CommandQueue:
    """Commands for the loop thread, queued from any thread, applied at the start of the next pass."""

    def __init__(self) -> None:
        self._commands: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.wakeup = threading.Event()

    def submit(self, command: Callable[[], None]) -> None:
        with self._lock:
            self._commands.append(command)
        self.wakeup.set()

    def drain(self) -> list[Callable[[], None]]:
        with self._lock:
            commands = self._commands
            self._commands = []
        return commands


class AsyncEngine:
    def __init__(self, engine: Engine, pass_delay: float = 0.0):
        self.engine = engine
        self.pass_delay = pass_delay  # testing aid: simulate a slower machine by sleeping after each pass
        self.commands = CommandQueue()
        self.stats: EngineStats = engine.stats()  # a snapshot, replaced after every pass
        # called on the loop thread after every pass: metrics and the server's pace, never engine state
        self.pass_listeners: list[Callable[[PassTiming], None]] = []
        self._streams: dict[int, ResultStream] = {}  # request id -> stream (loop thread only)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._threads = torch.get_num_threads()  # applied in the loop thread: OpenMP settings are per thread
        self._thread = threading.Thread(target=self._run, name="corolla-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self.commands.wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # --- called from the event loop ------------------------------------------------------------------------

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the loop thread between passes and return its result (or raise its error)."""
        future = self._loop.create_future()

        def command() -> None:
            try:
                result = fn()
            except Exception as e:  # delivered to the caller, who decides what it means
                self._loop.call_soon_threadsafe(_set_exception, future, e)
            else:
                self._loop.call_soon_threadsafe(_set_result, future, result)

        self.commands.submit(command)
        return await future

    def stream(self) -> ResultStream:
        """A new stream; an inference session keeps one for all its steps' results."""
        return ResultStream(self._loop)

    def submit(self, work: StepWork | ForwardWork, stream: ResultStream) -> None:
        """Queue work; a step's `announce` is called on the event loop (the engine calls it on the loop
        thread as the pass completing the step starts)."""
        if isinstance(work, StepWork) and work.announce is not None:
            work.announce = _on_loop(self._loop, work.announce)

        def command() -> None:
            if isinstance(work, StepWork) and work.session.session_id not in self.engine.sessions:
                stream.deliver(Completion(work.request_id, error=ServerUnavailable("the session is closed")))
                return
            self._streams[work.request_id] = stream
            (self.engine.add_step if isinstance(work, StepWork) else self.engine.add_forward)(work)

        self.commands.submit(command)

    def abort(self, request_id: int) -> None:
        def command() -> None:
            self.engine.abort(request_id)
            self._streams.pop(request_id, None)

        self.commands.submit(command)

    def drop(self, request_id: int) -> None:
        """Drop a step that has not started: its stream gets `StepDropped`. A step already in a pass (or
        done) is left alone and completes as usual."""

        def command() -> None:
            if self.engine.abort(request_id) and request_id in self._streams:
                self._streams.pop(request_id).deliver(
                    Completion(request_id, error=StepDropped("dropped before it ran"))
                )

        self.commands.submit(command)

    def close_session(self, session_id: str) -> None:
        self.commands.submit(lambda: self._deliver(self.engine.close_session(session_id)))

    def announce(self, session_id: str, at: float) -> None:
        """A session's next step is on its way (engine/batching.py): expected at monotonic time `at`."""
        self.commands.submit(lambda: self.engine.announce(session_id, at))

    def keep_session(self, session_id: str) -> None:
        """Keep an ended session for forks (engine/idle.py), or close it if it cannot be kept."""
        self.commands.submit(lambda: self.engine.keep_session(session_id))

    async def run(
        self, work: StepWork | ForwardWork, stream: ResultStream | None = None
    ) -> torch.Tensor | Gradients:
        """Submit work and wait for its result; if the caller goes away, the work is aborted."""
        stream = stream or self.stream()
        self.submit(work, stream)
        try:
            return await stream.next()
        except asyncio.CancelledError:
            self.abort(work.request_id)
            raise

    # --- the loop thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        enter_device(self.engine.span.device)
        while not self._stopping:
            for command in self.commands.drain():
                try:
                    command()
                except Exception:  # a command's bug must not stop the server's compute for every session
                    logger.exception("An engine command failed")
            if not self.engine.has_work():
                self._publish_stats()
                self.commands.wakeup.wait()
                self.commands.wakeup.clear()
                continue
            delay = self.engine.batch_delay(time.monotonic())
            if delay > 0:  # let more sessions' steps join this pass (new arrivals wake us early)
                self.commands.wakeup.wait(delay)
                self.commands.wakeup.clear()
                continue
            started = time.perf_counter()
            passes = self.engine.num_passes
            try:
                completions = self.engine.step()
            except Exception as e:
                logger.exception("Engine pass failed; failing every request in flight")
                completions = self._fail_all(e)
            if self.engine.num_passes != passes:
                self._tell_listeners(time.perf_counter() - started)
            if self.pass_delay > 0:
                time.sleep(self.pass_delay)
            self._publish_stats()  # before the results: a client that asks right after sees this pass
            self._deliver(completions)
            if not completions and time.perf_counter() - started < 1e-3:  # nothing could run: wait a little
                self.commands.wakeup.wait(IDLE_POLL_SECONDS)
                self.commands.wakeup.clear()
        self._deliver(self._fail_all(ServerUnavailable("the server is shutting down")))

    def _tell_listeners(self, seconds: float) -> None:
        engine = self.engine
        blocks = engine.span.end - engine.span.start
        timing = PassTiming(engine.batched_rows, engine.batched_tokens, blocks, seconds)
        for listener in self.pass_listeners:
            listener(timing)

    def _fail_all(self, cause: Exception) -> list[Completion]:
        error = (
            cause
            if isinstance(cause, CorollaError)
            else ServerUnavailable(f"the server's engine failed: {type(cause).__name__}: {cause}")
        )
        request_ids = self.engine.pending_request_ids()
        for request_id in request_ids:
            self.engine.abort(request_id)
        return [Completion(request_id, error=error) for request_id in request_ids]

    def _deliver(self, completions: list[Completion]) -> None:
        """Hand a pass's results to their streams with one wake-up of the event loop, not one per result
        (each wake-up is a system call and a hand-over of the interpreter lock between threads)."""
        ready = [
            (stream, completion)
            for completion in completions
            if (stream := self._streams.pop(completion.request_id, None)) is not None
        ]
        if ready:
            self._loop.call_soon_threadsafe(_put_all, ready)

    def _publish_stats(self) -> None:
        self.stats = self.engine.stats()


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[float], None]) -> Callable[[float], None]:
    return lambda seconds: loop.call_soon_threadsafe(fn, seconds)


def _put_all(ready: list[tuple[ResultStream, Completion]]) -> None:
    for stream, completion in ready:
        stream.put(completion)


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
