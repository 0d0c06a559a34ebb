"""Continuous batching in corolla's own servers, in this process (tests/loopback.py): results never depend
on batching, and paged cache memory is allocated as sessions use it, never as they declare it.

Batching changes which matrix kernels run (one row or many), so hidden states agree to float32 rounding,
not bit for bit: within 1e-4 relative to each value and to the hidden states' RMS. Greedy tokens must
match exactly; the test first checks that no chosen token was a near tie (top-2 logit gap below 1e-3),
where such rounding could legitimately flip the choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from corolla.client.chain.session import InferenceSession
from corolla.config import EngineConfig
from corolla.swarm.p2p.ping import fetch_status
from loopback import LoopbackNetwork, LoopbackSwarm

NEW_TOKENS = 16
CHAIN = [(0, 2), (2, 4), (4, 6)]
# prompts of 5 to 170 tokens: the longer ones take several passes of the engine's 128 tokens to prefill
PROMPTS = [
    torch.randint(3, 300, (1, 5 + 11 * i), generator=torch.Generator().manual_seed(i)) for i in range(16)
]
PAGED = EngineConfig(max_cache_tokens=4096, page_size=16, max_batch_wait_ms=0)


async def prefill(model, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """A session's prompt step: the hidden states at each block boundary of its chain (each hop's inputs
    are its predecessor's outputs; the last hop's are the step's), by block."""
    async with model.inference_session(max_length=ids.shape[1] + NEW_TOKENS) as session:
        outputs = await session.astep(model.head.embed(ids))
        found = {link.hop.start: link.history.inputs for link in session.chain.links[1:]}
        return {**found, session.route[-1].end: outputs}


async def generate(model, ids: torch.Tensor, on_first: Callable[[], None] | None = None) -> torch.Tensor:
    """The greedy tokens after ids; `on_first` is called once the first is chosen."""
    new = []
    async for tokens in model.agenerate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True):
        new.append(tokens)
        if len(new) == 1 and on_first is not None:
            on_first()
    return torch.cat(new)


def test_sixteen_staggered_sessions_get_exactly_their_solo_tokens(llama, reference):
    engine = EngineConfig(max_cache_tokens=4096, page_size=4, max_batch_wait_ms=0)
    with LoopbackSwarm(llama, CHAIN, engine=engine) as swarm:
        model = swarm.model()
        solo = [model.runtime.run(generate(model, ids)) for ids in PROMPTS]  # one at a time
        solo_prefill = [model.runtime.run(prefill(model, ids)) for ids in PROMPTS]
        assert_no_near_ties(reference, solo)

        started = [asyncio.Event() for _ in PROMPTS]
        held: list[int] = []  # sessions on the first server whenever one of them chose its first token

        async def one(index: int) -> tuple[dict, torch.Tensor]:
            if index:  # each session starts once the one before it has chosen its first token
                await asyncio.wait_for(started[index - 1].wait(), 60)
            boundaries = await prefill(model, PROMPTS[index])

            def on_first() -> None:
                held.append(swarm.servers[0].status.snapshot().num_sessions)
                started[index].set()

            return boundaries, await generate(model, PROMPTS[index], on_first)

        async def everyone():
            return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

        batched = model.runtime.run(everyone())
    assert max(held) >= 2  # sessions really overlapped on the servers
    for index, (boundaries, tokens) in enumerate(batched):
        assert torch.equal(tokens, solo[index]), f"session {index} differs"
        assert boundaries.keys() == solo_prefill[index].keys() == {2, 4, 6}
        for block, hidden in boundaries.items():
            assert_hidden_close(hidden, solo_prefill[index][block])


def assert_hidden_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1e-4 relative to the values, and to the hidden states' scale (their RMS) for small values:
    an element near zero inherits the rounding of the larger ones it was computed from."""
    scale = float(expected.pow(2).mean().sqrt())
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * scale)


def assert_no_near_ties(reference, generated: list[torch.Tensor]) -> None:
    for index, (ids, new) in enumerate(zip(PROMPTS, generated, strict=True)):
        full = torch.cat([ids[0], new])[None]
        with torch.no_grad():
            logits = reference(full).logits[0, ids.shape[1] - 1 : -1]  # the logits that chose each new token
        top2 = logits.topk(2, dim=-1).values
        gap = float((top2[:, 0] - top2[:, 1]).min())
        assert gap > 1e-3, f"prompt {index} leads to a near tie (gap {gap:.2e}); choose another prompt"


async def until(predicate, timeout: float = 5.0) -> bool:
    """Poll predicate() until it holds or `timeout` seconds pass; its last value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate() and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return predicate()


async def test_twenty_sessions_declaring_2048_tokens_share_a_4096_token_cache(llama):
    """Only what sessions use is allocated: 20 x 2048 declared tokens, 20 x 140 used, all at once."""
    network = LoopbackNetwork(llama, engine=PAGED)
    try:
        server = await network.add_server((0, 6), inference_max_length=2048)
        client = network.client()
        sessions = [await InferenceSession(client.swarm, None, 2048).aopen() for _ in range(20)]
        try:
            prompts = torch.randn(20, 1, 100, 64, generator=torch.Generator().manual_seed(0))
            for session, prompt in zip(sessions, prompts, strict=True):
                await session.astep(prompt)
            for _ in range(40):  # 40 decode steps each, all sessions open throughout
                await asyncio.gather(*(s.astep(torch.randn(1, 1, 64)) for s in sessions))
            assert [s.position for s in sessions] == [140] * 20
            load = await fetch_status(
                client.swarm.peers.transport, server.peer_id, 10.0
            )  # as the server reports itself
            assert load.num_sessions == 20
            assert load.cache_tokens_available == 4096 - 20 * 144  # 9 pages of 16 per session
        finally:
            await asyncio.gather(*(s.aclose() for s in sessions))
        assert await until(lambda: server.status.snapshot().cache_tokens_available == 4096)
        assert server.status.snapshot().num_sessions == 0
    finally:
        await network.close()


async def test_hundred_sessions_opened_and_closed_leave_the_pool_full(llama):
    network = LoopbackNetwork(llama, engine=PAGED)
    try:
        server = await network.add_server((0, 6), inference_max_length=2048)
        client = network.client()
        assert server.status.snapshot().cache_tokens_available == 4096
        for i in range(100):  # of 1 or 2 rows, 1 to 20 tokens
            async with InferenceSession(client.swarm, None, 64) as session:
                await session.astep(torch.randn(1 + i % 3 // 2, 1 + i % 20, 64))
        assert await until(lambda: server.status.snapshot().cache_tokens_available == 4096)
        assert server.status.snapshot().num_sessions == 0
    finally:
        await network.close()
