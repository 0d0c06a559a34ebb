"""A local SmolLM2 swarm with a client on it, many sessions through that client at once, and a server's own
counters (a client's configuration for a swarm elsewhere: corolla.launch.local `client_config`).

What the benchmarks repeat around corolla.launch.local.LocalSwarm and DistributedModelForCausalLM; each
script still decides the spans, the servers' options and what it measures. corolla is imported where it
is used, so that importing this module leaves the environment's defaults in force.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


@contextmanager
def smollm2_swarm(
    spans: Sequence[tuple[int, int]] | None = None,
    server_args: Sequence[str] = (),
    num_threads: int = 1,
    **client: object,
) -> Iterator[tuple]:
    """(swarm, model): SmolLM2 served on 127.0.0.1 over `spans` (3 servers of 10 blocks unless given),
    `num_threads` torch threads per server, and a client on it (`client`: ClientConfig fields)."""
    from corolla.client.model import DistributedModelForCausalLM
    from corolla.launch.local import LocalSwarm, even_spans

    spans = even_spans(30, 3) if spans is None else list(spans)
    with (
        LocalSwarm("smollm2", spans, num_threads=num_threads, server_args=list(server_args)) as swarm,
        DistributedModelForCausalLM.from_pretrained("smollm2", config=swarm.client_config(**client)) as model,
    ):
        yield swarm, model


@dataclass
class Sessions:
    """Concurrent sessions: when each started, when each of its tokens arrived, the wall time of all."""

    starts: list[float]
    stamps: list[list[float]]
    elapsed: float


def concurrent(model, prompts: Sequence[list[int]], new_tokens: int) -> Sessions:
    """Each prompt a greedy session (EOS ignored), all at once as asyncio tasks on the client's event loop
    (as the API server runs them)."""
    starts = [0.0] * len(prompts)
    stamps: list[list[float]] = [[] for _ in prompts]

    async def session(index: int) -> None:
        starts[index] = time.perf_counter()
        async for _ in model.agenerate(prompts[index], max_new_tokens=new_tokens, ignore_eos=True):
            stamps[index].append(time.perf_counter())

    async def together() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(session(i) for i in range(len(prompts))))
        return time.perf_counter() - started

    elapsed = model.runtime.run(together())
    return Sessions(starts, stamps, elapsed)


def server_status(model, peer_id: str, timeout: float = 10.0):
    """What a server says of itself (rpc_info: precision, counters), asked through the client."""
    from corolla.swarm.p2p.ping import fetch_status

    return model.runtime.run(fetch_status(model.client.swarm.peers.transport, peer_id, timeout))


def engine_counters(model) -> tuple[int, int]:
    """(rows, passes) run so far by every server the client knows (rows / passes: the mean batch)."""
    infos = [server_status(model, span.peer_id) for span in model.client.swarm.view.spans]
    return sum(i.engine_rows for i in infos), sum(i.engine_passes for i in infos)
