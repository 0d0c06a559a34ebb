"""One hosted span of blocks: its weights, its engine and its open sessions.

A server normally holds one backend. While it moves to other blocks it holds two: the new one takes new
sessions, and the old one keeps serving the sessions it has until they end (or a deadline passes), so a
move never drops a live session.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from corolla.engine.async_engine import AsyncEngine
from corolla.engine.engine import Engine, EngineConfig
from corolla.models import lora
from corolla.models.span import Span
from corolla.server.sessions import SessionRegistry


@dataclass(eq=False)
class SpanBackend:
    span: Span
    engine: AsyncEngine
    sessions: SessionRegistry
    accepting: bool = True  # new sessions and forward requests go only to a backend that accepts them

    @classmethod
    async def create(
        cls,
        folder: Path,
        blocks: tuple[int, int],
        dtype: torch.dtype,
        engine_config: EngineConfig,
        session_timeout: float,
        pass_delay: float = 0.0,
        adapters: Sequence[tuple[str, str]] = (),
    ) -> SpanBackend:
        """`adapters`: (name, PEFT folder) pairs whose LoRA weights for these blocks are loaded too."""
        span = await asyncio.to_thread(Span.load, folder, blocks[0], blocks[1], dtype)
        for name, path in adapters:
            adapter = await asyncio.to_thread(lora.load_adapter, path, range(*blocks), name)
            lora.attach(span.blocks, span.start, adapter)
        engine = AsyncEngine(Engine(span, engine_config), pass_delay=pass_delay)
        engine.start()
        return cls(span, engine, SessionRegistry(engine, session_timeout))

    @property
    def blocks(self) -> tuple[int, int]:
        return self.span.start, self.span.end

    async def stop(self) -> None:
        await self.engine.stop()
