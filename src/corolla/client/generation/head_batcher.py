"""The LM head shared by every session of a client, run for many sessions at once.

The head is the client's biggest cost per token (a [hidden x vocab] matrix, read from memory in full for
every call). Sessions generating concurrently ask for logits as their hidden states return from the
swarm; requests that arrive while a batch is computing are run together in the next one, off the event
loop, so one matrix read serves many tokens and the loop keeps serving the network meanwhile.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

from corolla.models.head import ModelHead

GATHER_SECONDS = 0.004


class HeadBatcher:
    def __init__(self, head: ModelHead):
        self.head = head
        # OpenMP thread settings are per thread: without this, a worker thread's matrix products use
        # every core, and the idle OpenMP workers then spin, burning CPU that servers on the same machine
        # need (measured: 3.4 ms of CPU per token)
        threads = torch.get_num_threads()
        self._executor = ThreadPoolExecutor(
            1, "corolla-head", initializer=torch.set_num_threads, initargs=(threads,)
        )
        self._queue: list[tuple[torch.Tensor, asyncio.Future]] = []
        self._draining = False
        self._arrived = asyncio.Event()
        self.num_active = 0  # generation loops running: how many requests a batch could hold
        self.num_batches = self.num_requests = 0  # head passes run, and the logits requests they served

    def register(self) -> None:
        self.num_active += 1

    def unregister(self) -> None:
        self.num_active -= 1

    async def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] (the last position of each row) -> float32 logits [B, vocab]."""
        future = asyncio.get_running_loop().create_future()
        self._queue.append((hidden, future))
        self._arrived.set()
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._queue:
                await self._gather()
                batch = self._queue
                self._queue = []
                try:
                    pieces = [hidden for hidden, _ in batch]
                    logits = await asyncio.get_running_loop().run_in_executor(
                        self._executor, self._compute, pieces
                    )
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

    async def _gather(self) -> None:
        """Sessions whose tokens left the last server in the same pass reach us a moment apart: give
        them GATHER_SECONDS to join this batch (one read of the head matrix for all of them)."""
        deadline = asyncio.get_running_loop().time() + GATHER_SECONDS
        while len(self._queue) < self.num_active:
            self._arrived.clear()
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except (asyncio.TimeoutError, TimeoutError):
                return

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False)

    def _compute(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        self.num_batches += 1
        self.num_requests += len(pieces)
        with torch.no_grad():
            logits = self.head.logits(torch.cat(pieces)).float()  # [sum B, vocab]
        return list(logits.split([piece.shape[0] for piece in pieces]))
