"""Speculative decoding through chains of corolla's own servers in this process (tests/loopback.py):
drafts verified in one step give exactly the tokens of plain decoding (greedy and seeded sampling), with
every drafter, in every Llama-like family; stop strings, max_new_tokens and log-probabilities are those
of plain decoding (on SmolLM2: stop strings need a tokenizer); concurrent speculating sessions, whose
trees the servers batch with each other's steps, stay exact. (The verification walk, the depth budget and
the drafters alone: test_speculative.py; the OpenAI API with a drafter: the integration tests.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from corolla.config import SpeculationConfig
from loopback import LoopbackSwarm, generate_together
from swarm_helpers import reference_generate
from tiny_models import LLAMA_LIKE, load_reference

# chains of 3 servers (0:2, 2:4, 4:6) and of 2 (0:3, 3:6), as servers of one swarm
SPANS = [(0, 2), (2, 4), (4, 6), (0, 3), (3, 6)]
CHAINS = {3: [0, 1, 2], 2: [3, 4]}
DRAFTERS = {  # the tiny model drafts for itself: an exact draft, so trees are verified deep
    "lookup": lambda path: SpeculationConfig(draft="lookup"),  # pipelined (its likeliest chains)
    "lookup tree": lambda path: SpeculationConfig(draft="lookup", width=2, pipeline=1),
    # not adaptive: on a loaded machine the measured costs may shorten its drafts, and the test counts them
    "model chain": lambda path: SpeculationConfig(
        draft=str(path), width=1, max_depth=4, pipeline=1, adaptive=False
    ),
    # always pipelined (adaptive: the client would measure both ways and keep the faster)
    "model pipelined": lambda path: SpeculationConfig(draft=str(path), max_depth=3, adaptive=False),
    "model tree": lambda path: SpeculationConfig(draft=str(path), width=3, max_depth=3, adaptive=False),
}


def repetitive_prompt(seed: int) -> torch.Tensor:
    """Random tokens with a repeated stretch, so that prompt lookup finds matches."""
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(seed))
    return torch.cat([ids, ids[:, :6], ids], dim=1)


@pytest.fixture(scope="module", params=LLAMA_LIKE)
def family(request, tiny_models):
    path = tiny_models[request.param]
    with LoopbackSwarm(path, SPANS) as swarm:
        yield path, swarm, load_reference(path)


def chain_model(swarm: LoopbackSwarm, hops: int, **config):
    """A model whose client routes only through the chain of `hops` servers."""
    allowed = tuple(swarm.servers[i].peer_id for i in CHAINS[hops])
    return swarm.model(allowed_servers=allowed, **config)


def steps_received(swarm: LoopbackSwarm, hops: int) -> list[int]:
    return [swarm.servers[i].steps_received for i in CHAINS[hops]]


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_speculation_gives_transformers_tokens_through_three_servers(family, drafter):
    path, swarm, reference = family
    prompt = repetitive_prompt(1)
    expected = reference_generate(reference, prompt, max_new_tokens=24)
    model = chain_model(swarm, 3, speculation=DRAFTERS[drafter](path))
    before = steps_received(swarm, 3)
    assert torch.equal(model.generate(prompt, max_new_tokens=24), expected)
    stats = model.speculator.stats
    assert stats.emitted == 23 and stats.drafted > 0  # 24 tokens: the first comes with the prompt
    if not drafter.startswith("lookup"):  # an exact draft: most of each tree is accepted, each frame whole
        assert stats.tokens_per_step > 2 if stats.most_in_flight == 1 else stats.accepted == stats.drafted
    # every server of the chain verified every step (the prompt's, then each tree or frame), but for
    # pipelined frames past a rejected draft, which go no further once the rejection is known
    received = [b - a for a, b in zip(before, steps_received(swarm, 3), strict=True)]
    assert received[0] == 1 + stats.steps and received == sorted(received, reverse=True), received
    if stats.most_in_flight == 1:
        assert received == [1 + stats.steps] * 3


def test_pipelined_rejections_travel_as_pushed_rollbacks_and_stale_frames_stop(family):
    """Prompt lookup pipelined guesses wrong now and then: each rejection opens an epoch whose rollback the
    later servers take from their predecessor's push (they say they keep epochs), frames past a rejected
    draft go no further once it is known, and the tokens are plain decoding's."""
    path, swarm, reference = family
    prompt = repetitive_prompt(3)
    expected = reference_generate(reference, prompt, max_new_tokens=32)
    model = chain_model(swarm, 3, speculation=SpeculationConfig(draft="lookup", adaptive=False))
    servers = [swarm.servers[i] for i in CHAINS[3]]
    before = [server.inference.rollbacks_from_push for server in servers]
    assert torch.equal(model.generate(prompt, max_new_tokens=32), expected)
    stats = model.speculator.stats
    assert stats.most_in_flight > 1 and stats.accepted < stats.drafted  # pipelined, with rejections
    taken = [server.inference.rollbacks_from_push - b for server, b in zip(servers, before, strict=True)]
    assert taken[0] == 0 and taken[1] > 0 and taken[2] > 0, taken  # the first hop's come from the client


def test_pipelined_drafts_go_out_before_earlier_ones_are_verified(family):
    """After the first token the last server holds its replies back (and answers pings: busy, not frozen):
    the client still sends its next drafted chains, until 3 frames are in flight, then verifies them in
    order once the replies come; the tokens are plain decoding's."""
    path, swarm, reference = family
    prompt = repetitive_prompt(5)
    expected = reference_generate(reference, prompt, max_new_tokens=24)
    model = chain_model(swarm, 3, speculation=SpeculationConfig(draft=str(path), max_depth=3, adaptive=False))
    first, last = (swarm.servers[i] for i in (CHAINS[3][0], CHAINS[3][-1]))
    held = threading.Event()

    def hold_once(_token) -> None:
        if not held.is_set():
            held.set()
            swarm.runtime.loop.call_soon_threadsafe(last.hold_replies)

    result = []

    def generate() -> None:
        result.append(model.generate(prompt, max_new_tokens=24, streamer=hold_once))

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        assert held.wait(60)
        seen, since = first.steps_received, time.monotonic()
        while time.monotonic() - since < 1.0:  # until the client sends nothing more for a second
            time.sleep(0.05)
            if first.steps_received != seen:
                seen, since = first.steps_received, time.monotonic()
    finally:
        swarm.runtime.loop.call_soon_threadsafe(last.replying.set)
        worker.join(60)
    assert torch.equal(result[0], expected)
    assert model.speculator.stats.most_in_flight == 3


def test_seeded_sampling_with_speculation_repeats_plain_sampling(family):
    path, swarm, _ = family
    prompt = repetitive_prompt(2)
    sampling = dict(max_new_tokens=20, do_sample=True, temperature=0.7, top_p=0.9, seed=11)
    expected = chain_model(swarm, 2).generate(prompt, **sampling)
    trees = SpeculationConfig(draft=str(path), width=2, max_depth=3)
    pipelined = SpeculationConfig(draft=str(path), max_depth=3, adaptive=False)
    for speculation in (trees, pipelined):
        model = chain_model(swarm, 2, speculation=speculation)
        assert torch.equal(model.generate(prompt, **sampling), expected)
        assert torch.equal(model.generate(prompt, **sampling), expected)  # twice
        assert model.speculator.stats.accepted > 0


def test_concurrent_speculative_sessions_batch_and_stay_exact(family):
    """Four sessions verify their draft trees at once: the servers batch trees with each other's steps,
    and each keeps only its own accepted paths."""
    path, swarm, reference = family
    prompts = [repetitive_prompt(seed) for seed in range(3, 7)]
    expected = [reference_generate(reference, ids, max_new_tokens=24) for ids in prompts]
    model = chain_model(swarm, 3, speculation=DRAFTERS["model tree"](path))
    chain = [swarm.servers[i] for i in CHAINS[3]]
    results, held = model.runtime.run(generate_together(model, chain, prompts, 24))
    assert held == [len(prompts)] * len(chain)
    for actual, want in zip(results, expected, strict=True):
        assert torch.equal(actual, want)
    assert model.speculator.stats.accepted > 0  # drafted tokens were verified and kept


@pytest.fixture(scope="module")
def smol(smollm2_path):
    """SmolLM2 over two servers, and a model of it decoding without a draft."""
    with LoopbackSwarm(smollm2_path, [(0, 15), (15, 30)]) as swarm:
        yield swarm, swarm.model()


def chat_ids(tokenizer, request: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": request}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def collect_steps(model, ids, **kwargs) -> list:
    async def collect():
        return [step async for step in model.agenerate_steps(ids, **kwargs)]

    return model.runtime.run(collect())


def test_stop_strings_max_tokens_and_logprobs_are_those_of_plain_decoding(smol):
    swarm, plain = smol
    sentence = "The quick brown fox jumps over the lazy dog near the old mill by the river."
    ids = chat_ids(plain.tokenizer, f"Repeat this sentence exactly: {sentence}")
    # a fixed depth: the adaptive one follows measured step times, which a loaded machine stretches
    model = swarm.model(speculation=SpeculationConfig(adaptive=False))
    for kwargs in (dict(max_new_tokens=7), dict(max_new_tokens=40, stop=("mill",))):
        expected = plain.generate(ids, **kwargs)
        assert torch.equal(model.generate(ids, **kwargs), expected)
    assert expected.shape[1] < len(ids) + 40  # the stop string ended it
    stats = model.speculator.stats
    assert stats.accepted > stats.emitted / 2  # most of the quote was drafted by prompt lookup
    steps = collect_steps(plain, ids, max_new_tokens=12, logprobs=2)
    spec = collect_steps(model, ids, max_new_tokens=12, logprobs=2)
    assert [int(s.tokens[0]) for s in spec] == [int(s.tokens[0]) for s in steps]
    for a, b in zip(spec, steps, strict=True):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
        torch.testing.assert_close(a.top_values, b.top_values, atol=1e-4, rtol=0)
        assert torch.equal(a.top_ids, b.top_ids)
