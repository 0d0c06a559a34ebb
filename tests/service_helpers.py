"""Driving the inference service without sockets: a real engine on a tiny model, steps as typed messages."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from corolla.config import EngineConfig, ServerConfig
from corolla.models.model_config import ModelConfig
from corolla.server.hosting.backend import SpanLoader
from corolla.server.hosting.spans import HostedSpans
from corolla.server.inference.service import InferenceService, StepMessage
from corolla.wire import tensors as wire_tensors
from corolla.wire.messages import InferenceStep
from corolla.wire.records import block_uids

H = 64
UID = block_uids("tiny", 0, 6)
CLIENT, PREVIOUS = "client-peer", "previous-server"  # the session's owner, the hop it names as pushing


class RecordingPusher:
    """Stands in for the link to the next server: records what would be pushed."""

    def __init__(self):
        self.pushed: list[tuple[str | None, int]] = []
        self.announced: list[tuple[str | None, int, float]] = []  # (step id, position, seconds to come)

    async def push(self, outputs, meta, position, origin, from_session):
        self.pushed.append((meta.step_id, position))

    def announce(self, meta, position, origin, from_session, due_in):
        self.announced.append((meta.step_id, position, due_in))

    def end_session(self, origin, session_id):
        pass


@pytest.fixture
async def service(tiny_models):
    path = Path(tiny_models["llama"])
    engine = EngineConfig(max_cache_tokens=256, page_size=4, max_batch_wait_ms=0)
    loader = SpanLoader(path, ModelConfig.from_folder(path), torch.float32, engine, session_timeout=60)
    spans = HostedSpans("tiny", loader.load)
    await spans.start((0, 6))
    config = ServerConfig(model=str(path), step_timeout=10)
    service = InferenceService(spans, config, H, RecordingPusher(), num_blocks=8)
    yield service
    await spans.stop()


def message(hidden, step_id=None, position=None, first=False, session_id="s", pushed=False, **meta):
    if first:
        meta = {"max_length": 32, "session_id": session_id, "push_from": PREVIOUS, **meta}
    elif pushed:
        meta = dict(session_id=session_id, pushed=True, origin=CLIENT, **meta)
    else:
        meta = dict(push_from=PREVIOUS, **meta)
    step = InferenceStep(step_id=step_id, start_from_position=position, **meta)
    return StepMessage(UID, step, [wire_tensors.serialize(hidden)])


class Session:
    """One client session on the service: its stream of steps in, its replies out."""

    def __init__(self, service, first, owner=CLIENT):
        self.steps: asyncio.Queue = asyncio.Queue()
        self.replies = service.serve(first, self._later(), owner)

    async def _later(self):
        while (step := await self.steps.get()) is not None:
            yield step

    async def reply(self, timeout=10):
        done = await asyncio.wait_for(anext(self.replies), timeout)
        return done.step_id, wire_tensors.deserialize(done.outputs, "outputs")

    async def close(self):
        """End the client's stream; returns the replies that still came."""
        await self.steps.put(None)
        return [r async for r in self.replies]


def inputs(seed, *lengths):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, H, generator=generator) for n in lengths]
