"""Routing spreads sessions over replicas and steers new sessions away from a slow server."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from corolla.launch.local import LocalSwarm
from swarm_helpers import connect

ARGS = ["--announce-period", "1"]


@pytest.fixture(scope="module")
def replicas(tiny_models):
    with LocalSwarm(str(tiny_models["llama"]), [(0, 6), (0, 6)], server_args=ARGS) as swarm:
        yield swarm


def test_concurrent_sessions_split_between_two_replicas(replicas, tiny_models):
    with connect(tiny_models["llama"], replicas) as model:

        async def open_eight():
            sessions = await asyncio.gather(
                *(model.inference_session(max_length=32).aopen() for _ in range(8))
            )
            try:
                first = model.head.embed(torch.tensor([[5, 6]]))
                await asyncio.gather(*(session.astep(first) for session in sessions))  # opens them on servers
                routes = Counter(session.route[0].peer_id for session in sessions)
                loads = {
                    s.peer_id: (await model.client.swarm.peers.status(s.peer_id)).num_sessions
                    for s in replicas.servers
                }
                seen = {
                    s.peer_id: model.client.swarm.estimates.estimate(s) for s in model.client.swarm.view.spans
                }
                return routes, loads, seen
            finally:
                await asyncio.gather(*(session.aclose() for session in sessions))

        routes, loads, seen = model.runtime.run(open_eight())
    assert sum(routes.values()) == 8 and max(routes.values()) <= 6, seen
    assert loads == dict(routes)  # as the servers themselves count them


def test_new_sessions_avoid_a_slow_replica(tiny_models):
    spans = [(0, 6)]
    with LocalSwarm(str(tiny_models["llama"]), spans, server_args=ARGS) as swarm:
        slow = swarm.add_server((0, 6), extra_args=["--simulate-slow-ms", "40"])
        with connect(tiny_models["llama"], swarm) as model:
            used = Counter()
            for _ in range(12):  # one after another, each a short generation
                with model.inference_session(max_length=16) as session:
                    model.generate([5, 6, 7], session=session, max_new_tokens=4, ignore_eos=True)
                    used[session.route[0].peer_id == slow.peer_id] += 1
    assert used[True] <= 3, f"{used[True]} of 12 sessions went to the slow server"
