"""Constrained decoding (decoding/constraints.py) through the Chooser: whatever the logits say, each row's
output matches its grammar, rows stay independent, and rewinds and seeds behave as in plain decoding."""

import json

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from byte_tokenizer import EOS, byte_tokenizer
from corolla.decoding.chooser import Chooser, RowEnds
from corolla.decoding.constraints import json_schema_grammar, lark_grammar
from corolla.decoding.json_bounds import bounded_schema
from corolla.decoding.sampling import SamplingParams
from corolla.errors import InvalidRequest

VOCAB = 320  # wider than the tokenizer's 257 tokens, as models' embedding tables often are
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(), eos_token="<eos>")


def run(tokenizer, grammar, rows=1, steps=60, noise=0, **params) -> tuple[Chooser, list[str]]:
    """Decode with random logits (a model that knows nothing) under `grammar`; the rows' texts."""
    params = SamplingParams(max_new_tokens=steps, grammar=grammar, **params)
    chooser = Chooser(params, RowEnds(params, [EOS], tokenizer, rows), EOS, torch.zeros(rows, 1).long())
    logits = torch.Generator().manual_seed(noise)
    while not chooser.done:
        chooser.choose(torch.randn(rows, VOCAB, generator=logits) * 5)
    return chooser, texts(chooser, tokenizer)


def texts(chooser: Chooser, tokenizer) -> list[str]:
    return [tokenizer.decode([t for t in row.tolist() if t != EOS]) for row in chooser.context[:, 1:]]


def test_random_logits_still_give_json_matching_the_schema_and_then_eos(tokenizer):
    chooser, outputs = run(tokenizer, json_schema_grammar(SCHEMA), rows=3, do_sample=True, seed=1, noise=1)
    for text in outputs:
        value = json.loads(text)
        assert set(value) == {"city", "days"} and isinstance(value["days"], int)
        assert len(value["city"]) <= 6
    assert bool(chooser.ends.finished.all())  # each row ended with EOS once its JSON was complete
    assert len(set(outputs)) > 1  # rows are independent


def test_greedy_and_seeded_sampling_are_reproducible(tokenizer):
    grammar = json_schema_grammar(SCHEMA)
    assert run(tokenizer, grammar)[1] == run(tokenizer, grammar)[1]
    sampled = [run(tokenizer, grammar, do_sample=True, seed=3, temperature=0.8)[1] for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_a_lark_grammar_with_embedded_json(tokenizer):
    grammar = lark_grammar('start: "<call>" %json {"type": "array", "items": {"enum": ["a", "b"]}} "</call>"')
    _, (text,) = run(tokenizer, grammar, steps=80)
    assert text.startswith("<call>") and text.endswith("</call>")
    assert set(json.loads(text[6:-7])) <= {"a", "b"}


def test_a_rewind_replays_the_kept_tokens_into_the_matchers(tokenizer):
    chooser, (text,) = run(tokenizer, json_schema_grammar(SCHEMA), do_sample=True, seed=5, noise=5)
    full = chooser.context.clone()
    chooser.rewind(3)  # as after a spot check: the first three choices stand
    noise = torch.Generator().manual_seed(5)
    while not chooser.done:
        chooser.choose(torch.randn(1, VOCAB, generator=noise) * 5)
    assert torch.equal(chooser.context[:, :4], full[:, :4])
    json.loads(texts(chooser, tokenizer)[0])  # still valid after the matchers went back


def test_bad_grammars_and_combinations_are_refused():
    with pytest.raises(InvalidRequest, match="grammar is invalid"):
        lark_grammar("start: undefined_rule")
    with pytest.raises(InvalidRequest, match="ignore_eos"):
        SamplingParams(grammar=json_schema_grammar(True), ignore_eos=True)


def test_speculation_accepts_only_drafted_tokens_the_grammar_allows(tokenizer):
    from corolla.decoding.verify import verify
    from corolla.models.tree import TokenTree

    params = SamplingParams(max_new_tokens=5, grammar=lark_grammar('start: "ab"'))
    chooser = Chooser(params, RowEnds(params, [EOS], tokenizer, 1), EOS, torch.zeros(1, 1).long())
    logits = torch.zeros(3, VOCAB)
    logits[0, ord("x")] = logits[1, ord("b")] = logits[2, EOS] = 9.0  # the model would write "x"
    logits[0, ord("a")] = 1.0
    nodes = [0, ord("x"), ord("b")]  # the root, then the draft "xb"
    verified = verify(chooser, logits, nodes, TokenTree.chain(3))
    assert [int(s.tokens[0]) for s in verified.steps] == [ord("a")] and not verified.accepted  # "x" forbidden
    nodes = [ord("a"), ord("b")]  # the root (the token just chosen), then the draft "b"
    verified = verify(chooser, logits[1:], nodes, TokenTree.chain(2))
    assert [int(s.tokens[0]) for s in verified.steps] == [ord("b"), EOS] and verified.accepted == 1


def test_a_stop_string_ends_a_constrained_row_early(tokenizer):
    chooser, (text,) = run(tokenizer, json_schema_grammar(SCHEMA), stop=(", ",))
    assert text.startswith('{"city": "') and text.endswith(
        ", "
    )  # cut at the stop string, as without a grammar
    assert bool(chooser.ends.finished[0]) and chooser.num_chosen < 60


OPEN_SCHEMA = {  # as a user writes it: no additionalProperties, no maxLength, no maxItems, no integer bounds
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "tags"],
}


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.mark.parametrize("max_tokens", [30, 60, 100])
def test_an_open_schema_still_parses_within_a_small_max_tokens(smollm2_tokenizer, max_tokens):
    """A model that rambles (random logits over SmolLM2's vocabulary) under a schema that bounds nothing:
    extra keys are forbidden, and strings and arrays are bounded so that the object closes before
    max_tokens cuts it off."""
    tokenizer, eos = smollm2_tokenizer, smollm2_tokenizer.eos_token_id
    params = SamplingParams(max_new_tokens=max_tokens, grammar=json_schema_grammar(OPEN_SCHEMA, max_tokens))
    for noise in range(6):
        chooser = Chooser(params, RowEnds(params, [eos], tokenizer, 1), eos, torch.zeros(1, 1).long())
        logits = torch.Generator().manual_seed(noise)
        while not chooser.done:
            chooser.choose(torch.randn(1, len(tokenizer), generator=logits) * 5)
        text = tokenizer.decode([t for t in chooser.context[0, 1:].tolist() if t != eos])
        value = json.loads(text)
        assert set(value) == {"name", "tags"} and isinstance(value["tags"], list), text
        assert bool(chooser.ends.finished.all())


def test_added_bounds_never_contradict_the_schemas_own_minimums(tokenizer):
    """A small budget shrinks the bounds on open strings and arrays, never below what the schema demands
    (minItems 3 with 64 tokens and three open ones gave maxItems 1: an unsatisfiable grammar, every such
    request refused)."""
    schema = {
        "type": "object",
        "properties": {
            "lines": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 3,
            },
            "word": {"type": "string", "minLength": 20},
        },
        "required": ["lines", "word"],
    }
    bounded = bounded_schema(schema, 40)  # 12 characters or items for each open one
    assert bounded["properties"]["lines"]["maxItems"] >= 3
    assert bounded["properties"]["word"]["maxLength"] >= 20
    _, (text,) = run(tokenizer, json_schema_grammar(schema, 40), steps=120, do_sample=True, seed=1)
    value = json.loads(text)
    assert len(value["lines"]) >= 3 and len(value["word"]) >= 20, text


def test_extra_keys_are_forbidden_unless_the_schema_allows_them(tokenizer):
    closed = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for noise in range(4):
        _, (text,) = run(tokenizer, json_schema_grammar(closed, 60), steps=60, do_sample=True, seed=noise)
        assert set(json.loads(text)) == {"a"}, text
    allowed = {**closed, "additionalProperties": {"type": "integer"}}
    extra = [
        run(tokenizer, json_schema_grammar(allowed), steps=200, do_sample=True, seed=n)[1][0]
        for n in range(8)
    ]
    assert any(set(json.loads(text)) > {"a"} for text in extra if text.endswith("}")), extra


def test_all_of_branches_keep_their_properties_together(tokenizer):
    parts = {
        "allOf": [
            {"properties": {"a": {"const": 1}}, "required": ["a"]},
            {"properties": {"b": {"type": "integer"}}, "required": ["b"]},
        ]
    }
    _, (text,) = run(tokenizer, json_schema_grammar({"type": "object", **parts}, 60), steps=60)
    assert {"a", "b"} <= set(json.loads(text)), text
