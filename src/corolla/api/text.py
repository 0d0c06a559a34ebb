"""Incremental detokenization of one choice, with stop strings that never reach the user.

Each token's text is released as soon as it is certain: text that could be the beginning of a stop
string, and an incomplete multi-byte character, are held back until the next token decides. When a stop
string appears, the text before it is released and the rest is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ChoiceText:
    def __init__(self, tokenizer: Any, stops: Sequence[str], eos_token_ids: Sequence[int], ignore_eos: bool):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.eos = frozenset(() if ignore_eos else eos_token_ids)
        self.token_ids: list[int] = []  # generated, EOS included
        self.text_ids: list[int] = []  # generated, EOS excluded: what the text is decoded from
        self.released = ""  # text given to the user so far
        self.finish_reason: str | None = None  # "stop" once EOS or a stop string is seen

    def add(self, token: int) -> str:
        """Take one generated token; returns the text it releases (possibly empty)."""
        if self.finish_reason is not None:
            return ""
        self.token_ids.append(token)
        if token in self.eos:
            self.finish_reason = "stop"
            return self._release(self._decode(), final=True)
        self.text_ids.append(token)
        text = self._decode()
        cuts = [text.find(stop) for stop in self.stops if stop in text]
        if cuts:
            self.finish_reason = "stop"
            return self._release(text[: min(cuts)], final=True)
        return self._release(text, final=False)

    def finish(self, reason: str = "length") -> str:
        """The generation ended without EOS or a stop string: release what was held back."""
        if self.finish_reason is not None:
            return ""
        self.finish_reason = reason
        return self._release(self._decode(), final=True)

    @property
    def text(self) -> str:
        return self.released

    def _decode(self) -> str:
        return self.tokenizer.decode(
            self.text_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def _release(self, text: str, final: bool) -> str:
        if not final:
            text = text[: len(text) - self._held(text)]
        if not text.startswith(self.released):  # the decoder revised earlier text: keep what was given
            return ""
        delta = text[len(self.released) :]
        self.released = text
        return delta

    def _held(self, text: str) -> int:
        """How many trailing characters to hold back: a possible stop-string start or a partial char."""
        if text.endswith("\ufffd"):
            return len(text) - len(text.rstrip("\ufffd"))
        held = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return held
