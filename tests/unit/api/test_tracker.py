"""The API's request tracker: a request is no longer active once its reader has seen the end."""

import asyncio
import threading

import pytest

from corolla.api.tracker import RequestTracker


@pytest.fixture
def model_loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


async def test_ended_requests_are_not_active_when_their_reader_sees_the_end(model_loop):
    tracker = RequestTracker(model_loop)

    def job(fail: bool):
        async def outputs():
            yield 1
            if fail:
                raise ValueError("no server covers blocks 3-5")

        return outputs

    for i in range(200):
        stream = tracker.add(f"r{i}", job(fail=i % 2 == 0))
        try:
            assert [item async for item in stream] == [1]
        except ValueError:
            pass
        assert tracker.num_active == 0, f"request {i} still active after its end was read"
        assert not tracker.abort(f"r{i}")


async def test_abort_cancels_a_running_job_and_ends_its_stream(model_loop):
    tracker = RequestTracker(model_loop)
    started = threading.Event()

    async def forever():
        started.set()
        await asyncio.sleep(3600)
        yield 0

    stream = tracker.add("r", lambda: forever())
    await asyncio.to_thread(started.wait, 5)
    assert tracker.abort("r")
    with pytest.raises(asyncio.CancelledError):
        await anext(stream)
    assert tracker.num_active == 0
