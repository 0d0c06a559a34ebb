"""The client's loop thread under Ctrl-C: any number of interrupts while a stream's step unwinds end the
iteration with one KeyboardInterrupt, after the step has unwound (never `aclose(): asynchronous generator
is already running`)."""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest

from corolla.client.runtime import LoopThread


def test_second_ctrl_c_while_a_step_unwinds_raises_keyboard_interrupt(terminal_sigint):
    runtime = LoopThread("test-runtime")
    unwound = threading.Event()

    async def stream():
        yield 1
        try:
            await asyncio.sleep(60)  # the step in flight when Ctrl-C comes
        finally:
            await asyncio.shield(asyncio.sleep(0.6))  # closing the session on its servers, say
            unwound.set()
        yield 2

    main = threading.main_thread().ident
    try:
        steps = runtime.iterate(stream())
        assert next(steps) == 1
        for delay in (0.2, 0.4):  # Ctrl-C, then again while the step unwinds
            threading.Timer(delay, signal.pthread_kill, (main, signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt) as raised:
            next(steps)
        assert unwound.is_set()
        assert not isinstance(raised.value.__context__, RuntimeError)
        assert runtime.run(asyncio.sleep(0, "still serving")) == "still serving"
    finally:
        runtime.stop()


def test_work_started_alongside_a_failed_load_is_closed_once_it_ends():
    """from_pretrained joins the swarm while it loads weights: when the load fails, the join is waited for
    and what it started shut down (a DHT peer, there), never left running."""
    closed = []

    class Joined:
        async def shutdown(self) -> None:
            closed.append(self)

    async def join() -> Joined:
        await asyncio.sleep(0.2)  # still joining when the load fails
        return Joined()

    runtime = LoopThread("test-runtime")
    joining = runtime.submit(join())
    runtime.stop_after(joining, Joined.shutdown)
    assert len(closed) == 1 and not runtime.loop.is_running()

    failing = LoopThread("test-runtime")

    async def fail() -> Joined:
        raise ConnectionError("no initial peer answered")

    failing.stop_after(failing.submit(fail()), Joined.shutdown)  # nothing to close; no error of its own
    assert len(closed) == 1 and not failing.loop.is_running()
