"""Speculative decoding through real servers: drafts verified in one step give exactly the tokens of plain
decoding (greedy and seeded sampling), with every drafter, through chains of servers that batch the
trees with other sessions' steps; stop strings, max_new_tokens, logprobs and the OpenAI API hold."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
import torch

from corolla.config import SpeculationConfig
from swarm_helpers import TINY_CHAINS, connect, reference_generate

DRAFTERS = {  # the tiny model drafts for itself: an exact draft, so trees are verified deep
    "lookup": lambda path: SpeculationConfig(draft="lookup"),
    "model chain": lambda path: SpeculationConfig(draft=str(path), width=1, max_depth=4, adaptive=False),
    "model tree": lambda path: SpeculationConfig(draft=str(path), width=3, max_depth=3, adaptive=False),
}


def repetitive_prompt(seed: int) -> torch.Tensor:
    """Random tokens with a repeated stretch, so that prompt lookup finds matches."""
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(seed))
    return torch.cat([ids, ids[:, :6], ids], dim=1)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_speculation_gives_transformers_tokens_through_three_servers(family_swarm, drafter):
    path, swarm, reference = family_swarm
    prompt = repetitive_prompt(1)
    expected = reference_generate(reference, prompt, max_new_tokens=24)
    speculation = DRAFTERS[drafter](path)
    with connect(path, swarm, TINY_CHAINS[3], speculation=speculation) as model:
        assert torch.equal(model.generate(prompt, max_new_tokens=24), expected)
        stats = model.speculator.stats
        assert stats.emitted == 23 and stats.drafted > 0  # 24 tokens: the first comes with the prompt
        if drafter != "lookup":
            assert stats.tokens_per_step > 2  # an exact draft: most of each tree is accepted


def test_seeded_sampling_with_speculation_repeats_plain_sampling(family_swarm):
    path, swarm, _ = family_swarm
    prompt = repetitive_prompt(2)
    sampling = dict(max_new_tokens=20, do_sample=True, temperature=0.7, top_p=0.9, seed=11)
    with connect(path, swarm, TINY_CHAINS[2]) as plain:
        expected = plain.generate(prompt, **sampling)
    speculation = SpeculationConfig(draft=str(path), width=2, max_depth=3)
    with connect(path, swarm, TINY_CHAINS[2], speculation=speculation) as model:
        assert torch.equal(model.generate(prompt, **sampling), expected)
        assert torch.equal(model.generate(prompt, **sampling), expected)  # twice
        assert model.speculator.stats.accepted > 0


def test_stop_strings_max_tokens_and_logprobs_are_those_of_plain_decoding(
    smollm2_path, smol_swarm, smol_client
):
    tokenizer = smol_client.tokenizer
    sentence = "The quick brown fox jumps over the lazy dog near the old mill by the river."
    chat = [{"role": "user", "content": f"Repeat this sentence exactly: {sentence}"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    with connect(smollm2_path, smol_swarm, speculation=SpeculationConfig()) as model:
        for kwargs in (dict(max_new_tokens=7), dict(max_new_tokens=40, stop=("mill",))):
            assert torch.equal(model.generate(ids, **kwargs), smol_client.generate(ids, **kwargs))
        assert model.speculator.stats.tokens_per_step > 1.5  # the quote is drafted by prompt lookup
        steps = _steps(smol_client, ids, max_new_tokens=12, logprobs=2)
        spec = _steps(model, ids, max_new_tokens=12, logprobs=2)
    assert [int(s.tokens[0]) for s in spec] == [int(s.tokens[0]) for s in steps]
    for a, b in zip(spec, steps, strict=True):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
        assert torch.equal(a.top_ids, b.top_ids)


def _steps(model, ids, **kwargs) -> list:
    async def collect():
        return [step async for step in model.agenerate_steps(ids, **kwargs)]

    return model.runtime.run(collect())


def test_concurrent_speculative_sessions_batch_and_stay_exact(smollm2_path, smol_swarm, smol_client):
    """Four sessions verify their drafts at once: the servers batch trees with each other's steps."""
    tokenizer = smol_client.tokenizer
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Count from {n} to {n + 12}, separated by commas."}],
                tokenize=False,
                add_generation_prompt=True,
            ),
            add_special_tokens=False,
        ).input_ids
        for n in (1, 20, 300, 4000)
    ]
    expected = [smol_client.generate(ids, max_new_tokens=24) for ids in prompts]
    results: list = [None] * len(prompts)
    with connect(smollm2_path, smol_swarm, speculation=SpeculationConfig()) as model:

        def run(i: int) -> None:
            results[i] = model.generate(prompts[i], max_new_tokens=24)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for actual, reference in zip(results, expected, strict=True):
        assert torch.equal(actual, reference)


def test_the_api_with_a_drafter_answers_the_same_with_speculation_on_and_off(smol_swarm):
    process = smol_swarm.add_api(extra_args=["--draft", "lookup", "--max-model-len", "1024"])
    try:
        sentence = "Seven silver swans swam slowly south across the silent lake at dawn."
        answers = []
        for speculative in (True, False):
            body = {
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": f"Repeat exactly: {sentence}"}],
                "max_tokens": 32,
                "temperature": 0,
                "speculative": speculative,
            }
            request = urllib.request.Request(
                f"{process.url}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as response:
                answers.append(json.load(response)["choices"][0]["message"]["content"])
        assert answers[0] == answers[1] and answers[0]
    finally:
        process.stop()
        smol_swarm.apis.remove(process)
