"""The LM head shared by every session of a client, run for many sessions at once.

The head is the client's biggest cost per token (a [hidden x vocab] matrix, read from memory in full for
every call). Sessions generating concurrently ask for logits as their hidden states return from the
swarm; requests that arrive while a batch is computing are run together in the next one, off the event
loop, so one matrix read serves many tokens and the loop keeps serving the network meanwhile.
"""

from __future__ import annotations

import asyncio

import torch

from corolla.models.head import ModelHead


class HeadBatcher:
    def __init__(self, head: ModelHead):
        self.head = head
        self._queue: list[tuple[torch.Tensor, asyncio.Future]] = []
        self._draining = False

    async def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] (the last position of each row) -> float32 logits [B, vocab]."""
        future = asyncio.get_running_loop().create_future()
        self._queue.append((hidden, future))
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    logits = await asyncio.to_thread(self._compute, [hidden for hidden, _ in batch])
                except Exception as e:  # every waiting session learns of it
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(e)
                    continue
                for (_, future), rows in zip(batch, logits, strict=True):
                    if not future.done():  # its session may have been cancelled meanwhile
                        future.set_result(rows)
        finally:
            self._draining = False

    def _compute(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            logits = self.head.logits(torch.cat(pieces)).float()  # [sum B, vocab]
        return list(logits.split([piece.shape[0] for piece in pieces]))
