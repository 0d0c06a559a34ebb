"""Continuous batching through real servers: results never depend on batching; paged memory is real.

Batching changes which matrix kernels run (one row or many), so hidden states agree to float32 rounding,
not bit for bit: within 1e-4 relative to each value and to the hidden states' RMS (SmolLM2's activations
reach several thousand, where one float32 step is already 2.4e-4). Greedy tokens must match exactly; the
test first checks that no chosen token was a near tie (top-2 logit gap below 1e-3), where such rounding
could legitimately flip the choice.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from corolla.launch.local import LocalSwarm
from swarm_helpers import SMOL_CHAINS, connect, fresh_spans

QUESTIONS = [
    "What is the capital of France?",
    "Name a fruit.",
    "Why is the sky blue?",
    "Tell me a joke about cats.",
    "What is 2 plus 2?",
    "Describe the sea in one sentence.",
    "Who wrote Hamlet?",
    "What do bees make?",
    "Give me three colors.",
    "What is the opposite of hot?",
    "Please explain, in simple words that a child would understand, how rain forms in clouds and why it "
    "eventually falls down to the ground.",
    "What is the largest planet in the solar system, and why is it so big?",
    "Write a haiku about autumn leaves falling in a quiet park.",
    "What is the boiling point of water?",
    "Suggest a name for a small brown dog that likes to run.",
    "I am planning a trip to Japan next spring with two friends. We like food, old temples and long walks. "
    "Which three cities should we visit, and what should we eat there?",
]
NEW_TOKENS = 16


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def test_sixteen_staggered_sessions_get_exactly_their_solo_tokens(smollm2_path, smol_swarm, smol_reference):
    with connect(smollm2_path, smol_swarm, SMOL_CHAINS[3]) as model:
        prompts = [chat_ids(model.tokenizer, q) for q in QUESTIONS]
        assert len({len(p) for p in prompts}) > 8  # really different prompt lengths

        solo, solo_prefill = [], []
        for ids in prompts:  # one at a time; each hop's prefill outputs are read after the first token
            with model.inference_session(max_length=len(ids) + NEW_TOKENS) as session:
                prefill: list = []
                tokens = model.generate(
                    ids,
                    session=session,
                    max_new_tokens=NEW_TOKENS,
                    ignore_eos=True,
                    streamer=lambda _, s=session, p=prefill: p or p.append(boundaries(s)),
                )
            solo.append(tokens[0, len(ids) :])
            solo_prefill.append(prefill[0])
        assert_no_near_ties(smol_reference, prompts, solo)

        batched: list = [None] * len(prompts)
        batched_prefill: list = [None] * len(prompts)

        async def one(index: int) -> None:
            await asyncio.sleep(0.04 * index)  # sessions start at different times
            ids = prompts[index]
            async with model.inference_session(max_length=len(ids) + NEW_TOKENS) as session:
                await session.astep(model.head.embed(torch.tensor([ids])))
                batched_prefill[index] = boundaries(session)
            tokens = [t async for t in model.agenerate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)]
            batched[index] = torch.cat(tokens)

        async def everyone() -> None:
            await asyncio.gather(*(one(i) for i in range(len(prompts))))

        chain = [smol_swarm.servers[i].peer_id for i in SMOL_CHAINS[3]]
        before = [model.runtime.run(model.client.swarm.peers.status(p)) for p in chain]
        model.runtime.run(everyone())
        after = [model.runtime.run(model.client.swarm.peers.status(p)) for p in chain]
        for old, new in zip(before, after, strict=True):  # the servers really ran sessions together
            assert (new.engine_rows - old.engine_rows) / (new.engine_passes - old.engine_passes) > 2
        for index in range(len(prompts)):
            assert torch.equal(batched[index], solo[index]), f"session {index} ({QUESTIONS[index]!r}) differs"
            common = solo_prefill[index].keys() & batched_prefill[index].keys()
            assert {10, 30} <= common  # the chains may split blocks 10-29 differently, never block 10 or 30
            for end in common:
                assert_hidden_close(batched_prefill[index][end], solo_prefill[index][end])


def boundaries(session) -> dict[int, torch.Tensor]:
    """Each hop's outputs of the last step, by the block where the hop ended."""
    return {hop.end: out for hop, out in zip(session.route, session.boundary_outputs, strict=True)}


def assert_hidden_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1e-4 relative to the values, and to the hidden states' scale (their RMS) for small values:
    an element near zero inherits the rounding of the thousands it was computed from."""
    scale = float(expected.pow(2).mean().sqrt())
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * scale)


def assert_no_near_ties(reference, prompts: list[list[int]], generated: list[torch.Tensor]) -> None:
    for question, ids, new in zip(QUESTIONS, prompts, generated, strict=True):
        full = torch.tensor([ids + new.tolist()])
        with torch.no_grad():
            logits = reference(full).logits[0, len(ids) - 1 : -1]  # the logits that chose each new token
        top2 = logits.topk(2, dim=-1).values
        gap = float((top2[:, 0] - top2[:, 1]).min())
        assert gap > 1e-3, f"{question!r} leads to a near tie (gap {gap:.2e}); choose another prompt"


@pytest.fixture(scope="module")
def paged_swarm(tiny_models):
    args = [
        "--max-cache-tokens",
        "4096",
        "--inference-max-length",
        "2048",
        "--block-size",
        "16",
        "--announce-period",
        "1",
    ]
    with LocalSwarm(str(tiny_models["llama"]), [(0, 6)], server_args=args) as swarm:
        yield swarm


def test_twenty_sessions_declaring_2048_tokens_share_a_4096_token_cache(paged_swarm, tiny_models):
    """Only what sessions use is allocated: 20 x 2048 declared tokens, 20 x 140 used, all at once."""
    with connect(tiny_models["llama"], paged_swarm) as model:
        prompts = torch.randint(3, 300, (20, 100), generator=torch.Generator().manual_seed(0))

        async def everyone():
            sessions = [await model.inference_session(max_length=2048).aopen() for _ in range(20)]
            try:
                for session, prompt in zip(sessions, prompts, strict=True):
                    await session.astep(model.head.embed(prompt[None]))
                for _ in range(40):  # 40 decode steps each, all sessions open throughout
                    await asyncio.gather(*(s.astep(torch.randn(1, 1, 64)) for s in sessions))
                info = await read_load(paged_swarm)
                return info, [s.position for s in sessions]
            finally:
                await asyncio.gather(*(s.aclose() for s in sessions))

        record, positions = model.runtime.run(everyone())
        assert positions == [140] * 20
        assert record.num_sessions == 20  # live load in the DHT announcement
        assert record.cache_tokens_available == 4096 - 20 * 144  # 9 blocks of 16 per session
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if model.runtime.run(read_load(paged_swarm)).cache_tokens_available == 4096:
                break
            time.sleep(0.5)
        assert model.runtime.run(read_load(paged_swarm)).cache_tokens_available == 4096


async def read_load(swarm: LocalSwarm):
    """The server's own DHT announcement, read fresh (it re-announces every second)."""
    await asyncio.sleep(1.5)
    (span,) = await fresh_spans(swarm)
    return span.info


def test_hundred_sessions_opened_and_closed_leave_the_pool_full(paged_swarm, tiny_models):
    with connect(tiny_models["llama"], paged_swarm) as model:
        before = model.runtime.run(read_load(paged_swarm)).cache_tokens_available

        async def churn():
            for i in range(100):
                async with model.inference_session(max_length=64) as session:
                    await session.astep(torch.randn(1 + i % 3 // 2, 1 + i % 20, 64))

        model.runtime.run(churn())
        after = model.runtime.run(read_load(paged_swarm))
        assert before == after.cache_tokens_available == 4096 and after.num_sessions == 0
