import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from byte_tokenizer import EOS, byte_tokenizer
from corolla.decoding.chooser import RowEnds
from corolla.decoding.sampling import (
    SamplingParams,
    apply_openai_penalties,
    apply_repetition_penalty,
    pick,
    processed_scores,
    top_logprobs,
    warp,
)
from corolla.errors import InvalidRequest


def next_tokens(logits, context, params, generator, output_ids=None):
    """What the Chooser does with one step's logits: the scores, then the choice."""
    return pick(processed_scores(logits, context, params, output_ids), params, generator)


def test_repetition_penalty_matches_transformers():
    logits, context = torch.randn(3, 50), torch.randint(0, 50, (3, 7))
    expected = RepetitionPenaltyLogitsProcessor(1.3)(context, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, context, 1.3), expected)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, None, 1.0), (1.0, 5, 1.0), (1.3, 10, 0.8), (1.0, None, 0.5)]
)
def test_warpers_match_transformers(temperature, top_k, top_p):
    logits = torch.randn(4, 64)
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.equal(torch.isinf(warp(logits, params)), torch.isinf(expected))
    torch.testing.assert_close(warp(logits, params)[~torch.isinf(expected)], expected[~torch.isinf(expected)])


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    logits, context = torch.randn(2, 1000), torch.zeros(2, 1, dtype=torch.long)

    def draw(seed):
        params = SamplingParams(do_sample=True, seed=seed)
        generator = params.make_generator()
        return torch.stack([next_tokens(logits, context, params, generator) for _ in range(20)])

    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits, context = torch.randn(3, 40), torch.zeros(3, 1, dtype=torch.long)
    assert torch.equal(next_tokens(logits, context, SamplingParams(), None), logits.argmax(-1))
    params = SamplingParams(do_sample=True, top_k=1, seed=0)
    assert torch.equal(next_tokens(logits, context, params, params.make_generator()), logits.argmax(-1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=0), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(stop=("",)), "stop strings"),
    ],
)
def test_invalid_parameters(kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**kwargs)


def test_stop_strings_across_token_boundaries():
    tokenizer = byte_tokenizer()
    ends = RowEnds(SamplingParams(stop=("END",)), [EOS], tokenizer, batch_size=2)
    steps = zip("xEND", "ENxx", strict=True)
    hits = [ends.update(torch.tensor([ord(a), ord(b)])).tolist() for a, b in steps]
    assert hits == [[False, False], [False, False], [False, False], [True, False]]
    assert ends.update(torch.tensor([EOS, ord("y")])).tolist() == [True, False]  # finished rows stay so
    assert ends.update(torch.tensor([ord("z"), EOS])).tolist() == [True, True]  # EOS ends a row
    with pytest.raises(InvalidRequest, match="need a tokenizer"):
        RowEnds(SamplingParams(stop=("x",)), [EOS], None, 1)


def test_openai_penalties_count_generated_tokens_only():
    logits = torch.zeros(1, 6)
    context = torch.tensor([[5, 5, 1, 1, 1, 2]])  # the prompt is [5, 5]; generated: 1, 1, 1, 2
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_openai_penalties(logits, context[:, 2:], params)
    assert out[0].tolist() == [0.0, -(0.5 + 3 * 0.25), -(0.5 + 0.25), 0.0, 0.0, 0.0]


def test_penalties_and_logit_bias_change_the_greedy_choice():
    logits = torch.tensor([[0.0, 3.0, 2.9]])
    context = torch.tensor([[1, 1]])
    assert next_tokens(logits, context, SamplingParams(), None).item() == 1
    penalized = SamplingParams(frequency_penalty=0.1)
    assert next_tokens(logits, context, penalized, None, output_ids=context).item() == 2
    assert next_tokens(logits, context, penalized, None, output_ids=context[:, :0]).item() == 1  # prompt only
    biased = SamplingParams(logit_bias=((0, 100.0),))
    assert next_tokens(logits, context, biased, None).item() == 0


def test_logprobs_are_those_of_the_raw_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 5.0]])
    chosen, values, ids = top_logprobs(logits, torch.tensor([0, 2]), 2)
    expected = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(chosen, torch.stack([expected[0, 0], expected[1, 2]]))
    assert ids[0].tolist() == [2, 1] and ids[1, 0].item() == 2
    assert torch.allclose(values[:, 0], expected.max(dim=-1).values)
    _, none, _ = top_logprobs(logits, torch.tensor([0, 2]), 0)
    assert none.shape == (2, 0)


@pytest.mark.parametrize(
    ("field", "value"), [("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("logprobs", 21)]
)
def test_out_of_range_openai_fields_are_refused(field, value):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**{field: value})
