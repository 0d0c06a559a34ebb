"""Routing by load, among corolla's own servers in this process (tests/loopback.py): a burst of sessions
spreads over replicas (as the servers themselves count them), and new sessions steer away from a replica
seen to be slow."""

from __future__ import annotations

import asyncio
from collections import Counter

import torch

from corolla.client.chain.session import InferenceSession
from corolla.swarm.p2p.ping import fetch_status


async def test_concurrent_sessions_split_between_two_replicas(network):
    replicas = [await network.add_server((0, 6)), await network.add_server((0, 6))]
    client = network.client()
    sessions = await asyncio.gather(*(InferenceSession(client.swarm, None, 32).aopen() for _ in range(8)))
    try:
        await asyncio.gather(*(session.astep(torch.randn(1, 2, 64)) for session in sessions))
        routes = Counter(session.route[0].peer_id for session in sessions)
        assert all(len(session.route) == 1 for session in sessions)
        loads = {
            s.peer_id: (await fetch_status(client.swarm.peers.transport, s.peer_id, 10.0)).num_sessions
            for s in replicas
        }
        seen = {s.peer_id: client.swarm.estimates.estimate(s) for s in client.swarm.view.spans}
        assert sum(routes.values()) == 8 and max(routes.values()) <= 6, seen
        assert loads == dict(routes)  # as the servers themselves count them
    finally:
        await asyncio.gather(*(session.aclose() for session in sessions))


async def test_new_sessions_avoid_a_slow_replica(network):
    await network.add_server((0, 6))
    slow = await network.add_server((0, 6), simulate_slow_ms=40)  # sleeps 40 ms after each engine pass
    client = network.client()
    used = Counter()
    for _ in range(12):  # one after another, each a prompt and three decode steps
        async with InferenceSession(client.swarm, None, 16) as session:
            await session.astep(torch.randn(1, 3, 64))
            for _ in range(3):
                await session.astep(torch.randn(1, 1, 64))
            used[session.route[0].peer_id == slow.peer_id] += 1
    assert used[True] <= 3, f"{used[True]} of 12 sessions went to the slow server"
