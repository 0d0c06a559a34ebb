"""One hosted span of blocks (its weights, its engine and its open sessions), and how one is loaded.

A server normally holds one backend. While it moves to other blocks it holds two: the new one takes new
sessions, and the old one keeps serving the sessions it has until they end (or a deadline passes), so a
move never drops a live session (server/hosting/spans.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from corolla.config import EngineConfig, ServerConfig
from corolla.engine.async_engine import AsyncEngine, PassTiming
from corolla.engine.engine import Engine
from corolla.errors import InvalidRequest
from corolla.models import lora
from corolla.models.devices import default_dtype, free_memory, resolve_device
from corolla.models.model_config import ModelConfig, parse_dtype
from corolla.models.span import Span
from corolla.server.faults import Fault
from corolla.server.inference.sessions import SessionRegistry
from corolla.utils import release_freed_memory

logger = logging.getLogger(__name__)

BUDGET_CACHE_TOKENS = 4096  # attention cache set aside per block when a memory budget sizes the span


@dataclass(eq=False)
class SpanBackend:
    span: Span
    engine: AsyncEngine
    sessions: SessionRegistry
    accepting: bool = True  # new sessions and forward requests go only to a backend that accepts them

    @property
    def blocks(self) -> tuple[int, int]:
        return self.span.start, self.span.end

    async def stop(self) -> None:
        await self.engine.stop()


@dataclass(frozen=True)
class SpanLoader:
    """Everything a span of this server's model is loaded with, at start and for every move."""

    folder: Path
    model: ModelConfig
    dtype: torch.dtype
    engine: EngineConfig
    session_timeout: float
    max_sessions_per_peer: int = 2**31
    budgeted: bool = False  # a memory budget sized the span: each block gets BUDGET_CACHE_TOKENS of cache
    pass_delay: float = 0.0  # testing aid: seconds the engine sleeps after each pass
    adapters: tuple[tuple[str, str], ...] = ()  # (name, PEFT folder) pairs loaded for every span
    # called on the engine's thread after every pass: metrics and the pace, never engine state
    pass_listeners: tuple[Callable[[PassTiming], None], ...] = ()
    quantize: str | None = None  # int8 | int4 weight-only (models/quantize.py)
    fault: Fault | None = None  # testing aid: wrong outputs on purpose (server/faults.py)
    device: torch.device = torch.device("cpu")  # of the weights, the cache and the passes (models/devices.py)

    def load_span(self, blocks: tuple[int, int]) -> Span:
        """The blocks' weights in the dtype, quantized when asked (blocking: reads the checkpoint)."""
        span = Span.load(self.folder, blocks[0], blocks[1], self.dtype, self.quantize, self.device)
        if self.fault is not None:
            self.fault.apply(span.blocks)
        release_freed_memory()  # the full-precision copies that loading and quantizing let go of
        return span

    async def load(self, blocks: tuple[int, int]) -> SpanBackend:
        span = await asyncio.to_thread(self.load_span, blocks)
        for name, path in self.adapters:
            adapter = await asyncio.to_thread(lora.load_adapter, path, range(*blocks), name)
            lora.attach(span.blocks, span.start, adapter)
        config = self.engine_config(span)
        logger.info(
            "Engine: %d cache tokens in pages of %d, %d tokens and %d rows per pass",
            config.max_cache_tokens,
            config.page_size,
            config.max_batch_tokens,
            config.max_batch_rows,
        )
        engine = AsyncEngine(Engine(span, config), pass_delay=self.pass_delay)
        engine.pass_listeners.extend(self.pass_listeners)
        engine.start()
        sessions = SessionRegistry(engine, self.session_timeout, self.max_sessions_per_peer)
        return SpanBackend(span, engine, sessions)

    def engine_config(self, span: Span) -> EngineConfig:
        """The configured engine, with its cache size chosen when the configuration left it open."""
        if self.engine.max_cache_tokens is not None:
            return self.engine
        if self.budgeted:
            return replace(self.engine, max_cache_tokens=BUDGET_CACHE_TOKENS)
        return replace(self.engine, max_cache_tokens=default_cache_tokens(span, self.model.wire.width))


def compute_settings(config: ServerConfig, model: ModelConfig) -> tuple[torch.device, torch.dtype]:
    """Where a server computes and in what: --device (default: the best available), then --dtype
    (default: by device, models/devices.py)."""
    device = resolve_device(config.device)
    return device, parse_dtype(config.dtype or default_dtype(device), model)


def default_cache_tokens(span: Span, width: int) -> int:
    """Tokens of cache in a share of the span's device's memory free now: a quarter of the host's (the
    pool is allocated lazily there: pages are touched as they are first written, so a large default costs
    memory only when sessions use it), 80% of a GPU's (where allocation is whole, and nothing else is
    kept). A token costs what the layers really cache (span.cache_bytes_per_token: a latent for
    multi-head latent attention), plus on the host the inputs kept for recompute. Capped at 2**18 tokens,
    and at least 1024."""
    per_token = span.cache_bytes_per_token
    if span.device.type == "cpu":
        tokens = int(free_memory(span.device) * 0.25) // (per_token + width * 4)
    else:
        tokens = int(free_memory(span.device) * 0.8) // per_token
    return max(1024, min(tokens, 2**18))


def adapter_names(specs: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """`NAME=PATH` or `PATH` (named after its folder) -> (name, path) pairs, names unique."""
    pairs = []
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        pairs.append((name or Path(path).name, path))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise InvalidRequest(f"--adapters: two adapters share a name among {names}")
    return tuple(pairs)
