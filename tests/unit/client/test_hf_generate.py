"""`model.generate` called as transformers users call it (client/hf/generate.py), over corolla's own servers
in this process (tests/loopback.py): attention masks and padded batches, transformers' streamers, its
argument names, and sampling that leaves the caller's random generator alone."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    SuppressTokensLogitsProcessor,
    TextIteratorStreamer,
)
from transformers.generation.streamers import BaseStreamer

from corolla.client.hf.generate import transformers_names, unpadded_rows
from corolla.errors import InvalidRequest
from loopback import LoopbackSwarm
from swarm_helpers import reference_generate

CHAIN = [(0, 3), (3, 6)]
NEW_TOKENS = 8
PAD = 0


@pytest.fixture(scope="module")
def swarm(llama):
    with LoopbackSwarm(llama, CHAIN) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def model(swarm):
    return swarm.model()


def prompts() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 300, (1, length), generator=generator) for length in (9, 4, 6)]


def padded(rows: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(row.shape[1] for row in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        span = slice(width - row.shape[1], width) if side == "left" else slice(0, row.shape[1])
        ids[index, span] = row[0]
        mask[index, span] = 1
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_gives_each_row_what_it_gets_alone(model, reference, side):
    rows = prompts()
    ids, mask = padded(rows, side)
    outputs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert outputs.shape == (len(rows), ids.shape[1] + NEW_TOKENS)
    assert torch.equal(outputs[:, : ids.shape[1]], ids)  # transformers' layout: the inputs as given
    for index, row in enumerate(rows):
        alone = reference_generate(reference, row, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert torch.equal(outputs[index, ids.shape[1] :], alone[0, row.shape[1] :]), f"row {index}"


def test_the_most_common_call_takes_a_tokenizers_output(model, reference):
    row = prompts()[0]
    inputs = {"input_ids": row, "attention_mask": torch.ones_like(row)}  # what a tokenizer returns
    outputs = model.generate(**inputs, max_length=row.shape[1] + 5, ignore_eos=True)
    assert torch.equal(outputs, reference_generate(reference, row, max_new_tokens=5, min_new_tokens=5))


def test_bad_masks_are_refused_naming_the_argument():
    ids = torch.arange(3, 9)[None]
    for mask, words in [
        (torch.ones(1, 5), "shape"),
        (torch.tensor([[1, 1, 0, 1, 1, 1]]), "between tokens"),
        (torch.zeros(1, 6), "masks every token"),
        (torch.tensor([[2, 1, 1, 1, 1, 1]]), "only 0"),
    ]:
        with pytest.raises(InvalidRequest, match="attention_mask") as error:
            unpadded_rows(ids, mask)
        assert words in str(error.value)
    assert unpadded_rows(ids, torch.ones(1, 6)) is None  # no padding: the batch runs as one


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)  # decodes the tiny model's ids (< 320) as any others


def test_a_text_iterator_streamer_in_a_thread_gets_the_text(model, tokenizer):
    row = prompts()[1]
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    results = []
    thread = threading.Thread(
        target=lambda: results.append(model.generate(row, max_new_tokens=NEW_TOKENS, streamer=streamer))
    )
    thread.start()
    text = "".join(streamer)
    thread.join(60)
    assert text == tokenizer.decode(results[0][0, row.shape[1] :])


def test_a_streamer_ends_when_the_generation_fails(model, tokenizer):
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        model.generate(prompts()[1], max_new_tokens=0, streamer=streamer)
    assert "".join(streamer) == ""  # the reader is told the end instead of waiting forever


def test_a_streamer_gets_the_prompt_then_every_token(model):
    class Recorder(BaseStreamer):
        def __init__(self) -> None:
            self.calls: list[list[int]] = []
            self.ended = False

        def put(self, value: torch.Tensor) -> None:
            self.calls.append(value.flatten().tolist())

        def end(self) -> None:
            self.ended = True

    row = prompts()[2]
    recorder = Recorder()
    outputs = model.generate(row, max_new_tokens=NEW_TOKENS, ignore_eos=True, streamer=recorder)
    assert recorder.calls[0] == row[0].tolist() and recorder.ended
    assert [token for call in recorder.calls[1:] for token in call] == outputs[0, row.shape[1] :].tolist()


def test_sampling_follows_torch_manual_seed_and_never_reseeds(model):
    row = prompts()[0]
    sampled = []
    for _ in range(2):
        torch.manual_seed(0)
        sampled.append(model.generate(row, max_new_tokens=NEW_TOKENS, do_sample=True, ignore_eos=True))
        assert torch.initial_seed() == 0  # torch.seed() would have set a new one
    assert torch.equal(*sampled)
    torch.manual_seed(1)
    other = model.generate(row, max_new_tokens=NEW_TOKENS, do_sample=True, ignore_eos=True)
    assert not torch.equal(other, sampled[0])


def test_transformers_names_for_length_and_stop_strings():
    ids = torch.arange(3, 9)[None]
    assert transformers_names(ids, {"max_length": 10, "stop_strings": "ab"}) == {
        "max_new_tokens": 4,
        "stop": ("ab",),
    }
    assert transformers_names(ids, {"max_length": 10, "max_new_tokens": 2}) == {"max_new_tokens": 2}
    with pytest.raises(InvalidRequest, match="max_length=6 leaves no room"):
        transformers_names(ids, {"max_length": 6})


def test_stop_strings_are_matched_with_the_tokenizer_given(model, reference, tokenizer):
    """generate(stop_strings=..., tokenizer=...) as transformers' generate takes it (it requires the
    tokenizer there): the row ends with the token that completes the string, where transformers ends it."""
    row = prompts()[0]
    plain = model.generate(row, max_new_tokens=NEW_TOKENS)
    texts = [tokenizer.decode(token) for token in plain[0, row.shape[1] :]]
    stop = next(text.strip() for text in texts[2:] if text.strip())  # a later token's text
    want = reference.generate(
        row, max_new_tokens=NEW_TOKENS, do_sample=False, stop_strings=[stop], tokenizer=tokenizer
    )
    got = model.generate(row, max_new_tokens=NEW_TOKENS, stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(got, want) and got.shape[1] < plain.shape[1]


def test_a_generation_config_and_its_refusals(model, reference):
    row = prompts()[0]
    config = GenerationConfig(max_new_tokens=5, do_sample=False)
    expected = reference_generate(reference, row, max_new_tokens=5, min_new_tokens=5)
    assert torch.equal(model.generate(row, generation_config=config, ignore_eos=True), expected)
    assert model.generate(row, generation_config=config, max_new_tokens=2).shape[1] <= row.shape[1] + 2
    for refused, words in [
        ({"generation_config": GenerationConfig(num_beams=2, do_sample=True)}, "greedy beams only"),
        ({"num_beams": 2, "num_return_sequences": 3}, "num_return_sequences"),
        ({"generation_config": GenerationConfig(min_p=0.1)}, "min_p"),
    ]:
        with pytest.raises(InvalidRequest, match=words):
            model.generate(row, **refused)


def test_eos_and_pad_token_ids(model):
    rows = prompts()[:2]
    ids, mask = padded(rows, "left")
    free = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    width = ids.shape[1]
    eos = int(free[0, width + 1])  # row 0 ends at its second token
    if eos in free[1, width:].tolist():
        pytest.skip("both rows choose that token")  # not with this seed: the check below always runs
    ended = model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=7
    )
    assert torch.equal(ended[0, : width + 2], free[0, : width + 2])
    assert ended[0, width + 2 :].tolist() == [7] * (NEW_TOKENS - 2)
    assert torch.equal(ended[1], free[1])


def test_the_checkpoints_generation_config_is_the_default(llama, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(llama, folder)
    GenerationConfig(max_new_tokens=3).save_pretrained(folder)
    with LoopbackSwarm(folder, CHAIN) as swarm:
        row = prompts()[0]
        assert swarm.model().generate(row, ignore_eos=True).shape[1] == row.shape[1] + 3
        assert swarm.model().generate(row, ignore_eos=True, max_new_tokens=4).shape[1] == row.shape[1] + 4


class StopAt(StoppingCriteria):
    """Ends a row once it has chosen `token` (a criterion of transformers' interface)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return input_ids[:, -1] == self.token


def test_logits_processors_and_stopping_criteria_as_transformers_runs_them(model, reference):
    row = prompts()[0]
    free = reference_generate(reference, row, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    banned = int(free[0, row.shape[1] + 1])  # what greedy picks second
    processors = LogitsProcessorList([SuppressTokensLogitsProcessor([banned])])
    expected = reference_generate(
        reference, row, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, logits_processor=processors
    )
    ours = model.generate(row, max_new_tokens=NEW_TOKENS, ignore_eos=True, logits_processor=processors)
    assert torch.equal(ours, expected) and banned not in ours[0, row.shape[1] :].tolist()
    stop = int(free[0, row.shape[1] + 3])
    criteria = StoppingCriteriaList([StopAt(stop)])
    expected = reference_generate(reference, row, max_new_tokens=NEW_TOKENS, stopping_criteria=criteria)
    ours = model.generate(row, max_new_tokens=NEW_TOKENS, ignore_eos=True, stopping_criteria=criteria)
    assert torch.equal(ours, expected) and ours[0, -1] == stop


@pytest.mark.parametrize(
    "settings",
    [
        {"num_beams": 3},
        {"num_beams": 4, "num_return_sequences": 2, "length_penalty": 0.5},
        {"num_beams": 2, "early_stopping": True},
    ],
    ids=["3 beams", "4 beams, 2 returned", "early stopping"],
)
def test_beam_search_gives_transformers_sequences(model, reference, settings):
    rows = prompts()
    ids, mask = padded(rows, "left")
    with torch.no_grad():
        expected = [
            reference.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=10, **settings)
            for row in rows
        ]
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=10, **settings)
    per_row = settings.get("num_return_sequences", 1)
    width = ids.shape[1]
    for index, (row, theirs) in enumerate(zip(rows, expected, strict=True)):
        mine = ours[index * per_row : (index + 1) * per_row, width:]
        new = theirs[:, row.shape[1] :]
        assert torch.equal(mine[:, : new.shape[1]], new), f"row {index}"


def test_return_dict_in_generate_gives_transformers_scores_and_logits(model, reference):
    row = prompts()[0]
    asked = {"max_new_tokens": 5, "return_dict_in_generate": True, "output_scores": True}
    asked |= {"output_logits": True, "repetition_penalty": 1.3}
    theirs = reference_generate(reference, row, **asked)
    ours = model.generate(row, **asked)
    assert type(ours) is type(theirs) and torch.equal(ours.sequences, theirs.sequences)
    assert len(ours.scores) == len(ours.logits) == ours.sequences.shape[1] - row.shape[1] > 1
    for name in ("scores", "logits"):  # processed (the penalty) and raw
        for mine, expected in zip(getattr(ours, name), getattr(theirs, name), strict=True):
            torch.testing.assert_close(mine, expected, rtol=1e-4, atol=1e-4)
    assert not torch.equal(ours.scores[1], ours.logits[1])
    transitions = model.compute_transition_scores(ours.sequences, ours.scores, normalize_logits=True)
    expected = reference.compute_transition_scores(theirs.sequences, theirs.scores, normalize_logits=True)
    torch.testing.assert_close(transitions, expected, rtol=1e-4, atol=1e-4)


def test_a_padded_batchs_scores_are_each_rows_and_certain_padding_after_its_end(model):
    rows = prompts()
    ids, mask = padded(rows, "left")
    asked = {"max_new_tokens": 6, "return_dict_in_generate": True, "output_scores": True, "ignore_eos": True}
    alone = [model.generate(row, **asked) for row in rows]
    ours = model.generate(ids, attention_mask=mask, **asked)
    for index, single in enumerate(alone):
        for step, scores in enumerate(single.scores):
            torch.testing.assert_close(ours.scores[step][index], scores[0], rtol=1e-4, atol=1e-4)
    # row 1 ends at its second token; steps after that make its padding certain
    end = int(alone[1].sequences[0, rows[1].shape[1] + 1])
    asked |= {"ignore_eos": False, "eos_token_id": end, "pad_token_id": PAD}
    ended = model.generate(ids, attention_mask=mask, **asked)
    assert torch.equal(ended.sequences[1, ids.shape[1] + 2 :], torch.full((4,), PAD))
    for after in ended.scores[2:]:
        assert after[1, PAD] == 0 and bool(torch.isinf(after[1]).sum() == after.shape[1] - 1)


@pytest.mark.parametrize("scores", [False, True], ids=["sequences", "with scores"])
def test_beam_search_returns_transformers_output(model, reference, scores):
    row = prompts()[1]
    settings = {
        "num_beams": 3,
        "num_return_sequences": 2,
        "max_new_tokens": 6,
        "return_dict_in_generate": True,
    }
    settings |= {"output_scores": scores, "output_logits": scores, "length_penalty": 0.7}
    with torch.no_grad():
        theirs = reference.generate(row, attention_mask=torch.ones_like(row), **settings)
    ours = model.generate(row, **settings)
    assert type(ours) is type(theirs) and torch.equal(ours.sequences, theirs.sequences)
    assert torch.equal(ours.beam_indices, theirs.beam_indices)
    if not scores:
        assert ours.sequences_scores is theirs.sequences_scores is ours.scores is theirs.scores is None
        return
    torch.testing.assert_close(ours.sequences_scores, theirs.sequences_scores, rtol=1e-4, atol=1e-4)
    for name in ("scores", "logits"):
        assert len(getattr(ours, name)) == len(getattr(theirs, name))
        for mine, expected in zip(getattr(ours, name), getattr(theirs, name), strict=True):
            torch.testing.assert_close(mine, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(InvalidRequest, match="one prompt per call"):
        ids, mask = padded(prompts(), "left")
        model.generate(ids, attention_mask=mask, **settings)


def test_what_stays_on_the_servers_and_unknown_names_are_refused(model):
    row = prompts()[0]
    with pytest.raises(InvalidRequest, match="output_hidden_states: the blocks run on servers"):
        model.generate(row, max_new_tokens=2, output_hidden_states=True)
    with pytest.raises(InvalidRequest, match="generate does not take temprature"):
        model.generate(row, max_new_tokens=2, temprature=0.5)
    with pytest.raises(InvalidRequest, match="do_sample"):
        model.generate(row, max_new_tokens=2, num_beams=2, do_sample=True)
    assert (
        model.generate(row, max_new_tokens=2, use_cache=True, output_attentions=False).shape[1] > row.shape[1]
    )


def test_to_moves_the_parts_computed_here(model, reference):
    row = prompts()[0]
    expected = reference_generate(reference, row, max_new_tokens=4)
    try:
        assert model.to(torch.bfloat16) is model and model.dtype == torch.bfloat16
        assert model.generate(row, max_new_tokens=4).shape[1] > row.shape[1]  # bfloat16 states cross
    finally:
        model.to("cpu", torch.float32)
    assert model.dtype == torch.float32 and model.device == torch.device("cpu")
    assert torch.equal(model.generate(row, max_new_tokens=4), expected)
