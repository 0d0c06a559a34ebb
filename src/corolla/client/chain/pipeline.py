"""A long step (a prompt) through a chain as a pipeline: in chunks, each hop on one chunk while the next
hop runs the chunk before it.

Sent whole, a prompt runs on one hop after another: every server but one waits. In chunks of
PIPELINE_CHUNK tokens, hop k runs chunk i while hop k + 1 runs chunk i - 1, so a prompt through n hops
takes about (chunks + n - 1) chunk times instead of chunks x n. Each hop gets its chunks in order, as
steps at their positions (the client's copies, passed on as they came; no push), and its history
records each, so it holds exactly what the whole step would have left. If a server fails, the hops stop
taking new chunks and the caller runs the whole step again the usual way (client/chain/chain.py): at the same
position, which rolls every hop back to it, with failover. Greedy tokens are the same: a chunked prefill
computes every position once, against the same cache.
"""

from __future__ import annotations

import asyncio

import torch

from corolla.client.rpc.span_stream import Step, StepRoute
from corolla.errors import RETRYABLE

PIPELINE_CHUNK = 256  # tokens per chunk; a step of fewer than two chunks runs whole


async def run_pipelined(chain, hidden: torch.Tensor, position: int) -> list[torch.Tensor] | None:
    """Hidden states [B, T, H] at `position` through every hop of `chain` in chunks; each hop's outputs
    [B, T, H], or None if a server failed (nothing is lost: the caller runs the step the usual way)."""
    chunks = hidden.split(PIPELINE_CHUNK, dim=1)
    hops = len(chain.links)
    queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(hops + 1)]
    for chunk in chunks:
        queues[0].put_nowait((chunk, None))
    outputs: list[list[torch.Tensor]] = [[] for _ in range(hops)]
    failed: list[BaseException] = []

    async def hop(index: int) -> None:
        link = chain.links[index]
        offset = position
        for _ in chunks:
            item = await queues[index].get()
            if item is None or failed:  # an earlier hop failed: nothing more comes
                break
            chunk, encoded = item
            try:
                reply = await chain.send(link, Step(chunk, offset), StepRoute(), encoded)
            except RETRYABLE as e:
                failed.append(e)
                break
            outputs[index].append(reply.outputs)
            queues[index + 1].put_nowait((reply.outputs, reply.encoded))
            offset += chunk.shape[1]
        queues[index + 1].put_nowait(None)

    await asyncio.gather(*(hop(index) for index in range(hops)))
    if failed:
        return None
    return [torch.cat(parts, dim=1) for parts in outputs]
