"""Server-to-server push: a step's outputs go straight to the next server of the chain.

When a step carries `next_servers`, the server that computed it sends its outputs to the first of them
(`rpc_push`) while also replying to the client; the receiver starts that step at once instead of waiting
for the client to relay it. The client still sends every step itself (it keeps the inputs for failover),
and the receiver runs each step once, whichever copy arrives first. A push that fails changes nothing:
the client's copy does the work. Pushes are fire-and-forget tasks whose references are kept.
"""

from __future__ import annotations

import asyncio
import logging

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from corolla.wire import tensors as wire_tensors
from corolla.wire.messages import RPC_PUSH, InferenceStep
from corolla.wire.records import block_uids

logger = logging.getLogger(__name__)

PUSH_TIMEOUT = 10.0


class Pusher:
    def __init__(self, p2p: P2P, dht_prefix: str):
        self.p2p, self.dht_prefix = p2p, dht_prefix
        self._tasks: set[asyncio.Task] = set()

    def push(self, outputs: torch.Tensor, meta: InferenceStep, position: int) -> None:
        """Send a step's outputs (computed at `position`) on to the next server of its chain."""
        task = asyncio.create_task(self._send(outputs, meta, position))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, outputs: torch.Tensor, meta: InferenceStep, position: int) -> None:
        target, rest = meta.next_servers[0], meta.next_servers[1:]
        step = InferenceStep(
            step_id=meta.step_id,
            start_from_position=position,
            next_servers=rest,
            pushed=True,
            session_id=target.session_id,
        )
        request = runtime_pb2.ExpertRequest(
            uid=block_uids(self.dht_prefix, target.start, target.end),
            tensors=[wire_tensors.serialize(outputs)],
            metadata=step.to_bytes(),
        )
        try:
            await asyncio.wait_for(
                self.p2p.call_protobuf_handler(
                    PeerID.from_base58(target.peer_id), RPC_PUSH, request, runtime_pb2.ExpertResponse
                ),
                PUSH_TIMEOUT,
            )
        except Exception as e:  # the client's own copy of the step does the work
            logger.debug("Push to ...%s failed: %s", target.peer_id[-6:], e)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
