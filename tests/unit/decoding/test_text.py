"""IncrementalText: text released token by token, stop strings never released, partial characters held.

A real byte-level tokenizer: ASCII characters are one token each (id = code point), "é" is two tokens
whose first decodes to no complete character.
"""

from __future__ import annotations

import pytest

from byte_tokenizer import EOS, byte_tokenizer, ids
from corolla.decoding.text import IncrementalText
from corolla.errors import InvalidRequest

TOKENIZER = byte_tokenizer()


def text(stops=(), ignore_eos=False) -> IncrementalText:
    return IncrementalText(TOKENIZER, stops, [EOS], ignore_eos)


def feed(choice: IncrementalText, string: str) -> list[str]:
    return [choice.add(token) for token in ids(TOKENIZER, string)]


def test_text_is_released_as_it_comes():
    choice = text()
    assert feed(choice, "abc") == ["a", "b", "c"]
    assert choice.finish("length") == "" and choice.finish_reason == "length"
    assert choice.text == "abc" and len(choice.token_ids) == 3


def test_a_stop_string_is_never_released_and_ends_the_choice():
    choice = text(["END"])
    deltas = feed(choice, "hi EN")
    assert "".join(deltas) == "hi "  # "EN" may begin the stop string: held back
    assert choice.add(ord("D")) == "" and choice.finish_reason == "stop"
    assert choice.text == "hi "
    assert choice.add(ord("x")) == ""  # nothing after the end


def test_held_text_that_turns_out_not_to_be_a_stop_is_released():
    choice = text(["END"])
    assert "".join(feed(choice, "EN")) == ""
    assert choice.add(ord("d")) == "ENd"
    assert "".join(feed(choice, "E")) == ""
    assert choice.finish("length") == "E" and choice.text == "ENdE"


def test_the_earliest_of_several_stops_cuts_the_text():
    choice = text(["zz", "b"])
    feed(choice, "aab")
    assert choice.finish_reason == "stop" and choice.text == "aa"


def test_a_stop_string_split_over_many_tokens_is_found_once_complete():
    choice = text(["User:"])
    released = "".join(feed(choice, "Paris.\nUse"))
    assert released == "Paris.\n" and choice.finish_reason is None
    assert "".join(feed(choice, "r: hi")) == "" and choice.finish_reason == "stop"
    assert choice.text == "Paris.\n"


def test_eos_stops_without_text_unless_ignored():
    choice = text()
    feed(choice, "ok")
    assert choice.add(EOS) == "" and choice.finish_reason == "stop"
    assert choice.token_ids == [ord("o"), ord("k"), EOS]  # EOS counts as a generated token
    ignoring = text(ignore_eos=True)
    ignoring.add(EOS)
    assert ignoring.finish_reason is None


def test_an_incomplete_character_waits_for_the_next_token():
    choice = text()
    first, second = ids(TOKENIZER, "é")
    assert choice.add(ord("c")) == "c"
    assert choice.add(first) == ""  # half a character: never shown as U+FFFD
    assert choice.add(second) == "é"
    assert choice.text == "cé"


def test_concatenated_deltas_equal_the_whole_decode():
    string = "naïve café, 日本語 and \U0001f600 too"
    choice = text()
    released = "".join(feed(choice, string)) + choice.finish()
    assert released == string == TOKENIZER.decode(ids(TOKENIZER, string))


def test_a_tokenizer_without_a_tokenizers_backend_is_refused():
    with pytest.raises(InvalidRequest, match="needs the model folder's tokenizer.json"):
        IncrementalText(object(), ["x"])
