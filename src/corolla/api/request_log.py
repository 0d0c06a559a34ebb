"""What the API logs for operators: a line per request when it ends (id, model, tokens, time to first
token, tokens/s, status) and, every few seconds while there is traffic, the running requests and the
throughput since the last such line."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("corolla.api.requests")


@dataclass
class Record:
    id: str
    model: str
    prompt_tokens: int
    started: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    completion_tokens: int = 0
    status: str = "200"

    def line(self) -> str:
        now = time.perf_counter()
        ttft = "-" if self.first_token is None else f"{self.first_token - self.started:.3f}s"
        decoding = now - self.first_token if self.first_token is not None else 0.0
        speed = f"{(self.completion_tokens - 1) / decoding:.1f}" if decoding > 0 else "-"
        return (
            f"{self.id} model={self.model} prompt_tokens={self.prompt_tokens} "
            f"completion_tokens={self.completion_tokens} ttft={ttft} tokens/s={speed} "
            f"time={now - self.started:.3f}s status={self.status}"
        )


class RequestLog:
    def __init__(self) -> None:
        self.running: set[str] = set()
        self.prompt_tokens = self.generated_tokens = 0
        self.since = (time.perf_counter(), 0, 0)  # when the last stats line was due, and the counts then

    def start(self, request_id: str, model: str, prompt_tokens: int) -> Record:
        self.running.add(request_id)
        self.prompt_tokens += prompt_tokens
        return Record(request_id, model, prompt_tokens)

    def generated(self, tokens: int) -> None:
        self.generated_tokens += tokens

    def end(self, record: Record) -> None:
        self.running.discard(record.id)
        logger.info("%s", record.line())

    def stats_line(self) -> str | None:
        """Running requests and throughput since the last call; None if nothing ran meanwhile."""
        now = time.perf_counter()
        then, prompt, generated = self.since
        self.since = (now, self.prompt_tokens, self.generated_tokens)
        if not self.running and generated == self.generated_tokens and prompt == self.prompt_tokens:
            return None
        elapsed = max(now - then, 1e-9)
        prompt_speed = (self.prompt_tokens - prompt) / elapsed
        generated_speed = (self.generated_tokens - generated) / elapsed
        return (
            f"running requests: {len(self.running)}, prompt tokens/s: {prompt_speed:.1f}, "
            f"generated tokens/s: {generated_speed:.1f}"
        )

    async def report_every(self, interval: float) -> None:
        """Log `stats_line` every `interval` seconds while there is traffic (until cancelled)."""
        while True:
            await asyncio.sleep(interval)
            line = self.stats_line()
            if line is not None:
                logger.info("%s", line)
