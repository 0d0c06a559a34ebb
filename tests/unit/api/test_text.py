"""ChoiceText: text released token by token, stop strings never released, partial characters held."""

from __future__ import annotations

from corolla.api.text import ChoiceText

EOS = 0


class CharTokenizer:
    """Token id = a character's code point; EOS (0) is a special token. Byte-level models can end a token
    in the middle of a character: token 1 stands for "half of the next character" and decodes to U+FFFD
    until that character (token 2 = "é") completes it."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        text = ""
        for i, token in enumerate(ids):
            if token == EOS:
                text += "" if skip_special_tokens else "</s>"
            elif token == 1:
                text += "\ufffd" if i + 1 == len(ids) or ids[i + 1] != 2 else ""
            elif token == 2:
                text += "é"
            else:
                text += chr(token)
        return text


def feed(choice: ChoiceText, text: str) -> list[str]:
    return [choice.add(ord(char)) for char in text]


def test_text_is_released_as_it_comes():
    choice = ChoiceText(CharTokenizer(), [], [EOS], ignore_eos=False)
    assert feed(choice, "abc") == ["a", "b", "c"]
    assert choice.finish("length") == "" and choice.finish_reason == "length"
    assert choice.text == "abc" and len(choice.token_ids) == 3


def test_a_stop_string_is_never_released_and_ends_the_choice():
    choice = ChoiceText(CharTokenizer(), ["END"], [EOS], ignore_eos=False)
    deltas = feed(choice, "hi EN")
    assert "".join(deltas) == "hi "  # "EN" may begin the stop string: held back
    assert choice.add(ord("D")) == "" and choice.finish_reason == "stop"
    assert choice.text == "hi "
    assert choice.add(ord("x")) == ""  # nothing after the end


def test_held_text_that_turns_out_not_to_be_a_stop_is_released():
    choice = ChoiceText(CharTokenizer(), ["END"], [EOS], ignore_eos=False)
    assert "".join(feed(choice, "EN")) == ""
    assert choice.add(ord("d")) == "ENd"
    assert "".join(feed(choice, "E")) == ""
    assert choice.finish("length") == "E" and choice.text == "ENdE"


def test_the_earliest_of_several_stops_cuts_the_text():
    choice = ChoiceText(CharTokenizer(), ["zz", "b"], [EOS], ignore_eos=False)
    feed(choice, "aab")
    assert choice.finish_reason == "stop" and choice.text == "aa"


def test_eos_stops_without_text_unless_ignored():
    choice = ChoiceText(CharTokenizer(), [], [EOS], ignore_eos=False)
    feed(choice, "ok")
    assert choice.add(EOS) == "" and choice.finish_reason == "stop"
    assert choice.token_ids == [ord("o"), ord("k"), EOS]  # EOS counts as a generated token
    ignoring = ChoiceText(CharTokenizer(), [], [EOS], ignore_eos=True)
    ignoring.add(EOS)
    assert ignoring.finish_reason is None


def test_an_incomplete_character_waits_for_the_next_token():
    choice = ChoiceText(CharTokenizer(), [], [EOS], ignore_eos=False)
    assert choice.add(ord("c")) == "c"
    assert choice.add(1) == ""  # half a character: U+FFFD is never shown
    assert choice.add(2) == "é"
    assert choice.text == "cé"
