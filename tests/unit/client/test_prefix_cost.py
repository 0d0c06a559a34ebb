"""Whether forking the chain that holds a prefix pays (client/generation/prefix_cost.py): pure arithmetic over
routing's step-time estimates and the length of this client's recent answers."""

from __future__ import annotations

from corolla.client.generation.prefix_cost import (
    ALIKE,
    DEFAULT_ANSWER,
    PREFILL_TOKENS_PER_STEP,
    RECENT_ANSWERS,
    AnswerLengths,
    fork_pays,
)


def test_chains_timed_alike_always_reuse_whatever_the_answer_length():
    """Replicas whose estimates differ by timing noise: a long answer never turns reuse down."""
    assert fork_pays(held=0.1 * ALIKE, best=0.1, length=16, steps=100_000)
    assert fork_pays(held=0.05, best=0.1, length=16, steps=100_000)  # the holder is the faster one


def test_a_slower_holder_is_reused_while_its_extra_decode_time_is_below_the_prefill_saved():
    best, held = 0.1, 0.2  # each step costs 0.1 s more on the holder
    length = 27 * 40  # its prefill costs 40 decode steps' time on the best chain: 4 s
    assert PREFILL_TOKENS_PER_STEP == 27
    assert fork_pays(held, best, length, steps=40)
    assert not fork_pays(held, best, length, steps=41)
    assert not fork_pays(held=100.0, best=0.1, length=length, steps=1)


def test_an_answer_is_guessed_from_recent_answers_under_the_requests_limit():
    answers = AnswerLengths()
    assert answers.expected(limit=10_000) == DEFAULT_ANSWER  # nothing seen yet
    assert answers.expected(limit=5) == 5
    for tokens in (10, 20, 30):
        answers.add(tokens)
    assert answers.expected(limit=10_000) == 20  # not the limit: the API's default is the whole context
    assert answers.expected(limit=7) == 7
    for _ in range(RECENT_ANSWERS):
        answers.add(100)
    assert answers.expected(limit=10_000) == 100  # older answers are forgotten
    answers.add(-3)  # a failed count never makes the guess negative
    assert answers.expected(limit=0) == 0
