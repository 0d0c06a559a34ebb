"""One row's generated text, decoded token by token, with stop strings that never reach the user.

The one detokenizer of corolla: generation (to end a row at a stop string), the OpenAI API (to stream
each choice's text) and `corolla generate` (to print) all use it. Decoding is incremental, with the
tokenizers library's `DecodeStream`: each token costs the decoding of that token (a multi-byte character
split over tokens is released once it is complete), never the whole text again. Text that could be the
beginning of a stop string is held back until the next token decides; when a stop string appears, the
text before it is released and the rest is dropped. EOS ends the text without being shown.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from corolla.errors import InvalidRequest


class IncrementalText:
    def __init__(
        self,
        tokenizer: Any,
        stops: Sequence[str] = (),
        eos_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
    ):
        """`tokenizer`: a transformers tokenizer backed by the tokenizers library, or its `Tokenizer`."""
        backend = tokenizer
        if not isinstance(backend, Tokenizer):
            backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise InvalidRequest(
                "decoding text token by token (stop strings, streamed text) needs the model folder's "
                "tokenizer.json (a tokenizers-backed tokenizer); this model has none"
            )
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True)
        self.stops = tuple(stops)
        self.eos = frozenset(() if ignore_eos else eos_token_ids)
        self.token_ids: list[int] = []  # generated, EOS included
        self.decoded = ""  # the text of every complete character so far (stop strings included)
        self.released = ""  # text given to the user so far
        self.finish_reason: str | None = None  # "stop" once EOS or a stop string is seen

    @property
    def text(self) -> str:
        return self.released

    def add(self, token: int) -> str:
        """Take one generated token; returns the text it releases (possibly empty)."""
        if self.finish_reason is not None:
            return ""
        self.token_ids.append(token)
        if token in self.eos:
            return self.finish("stop")
        searched = len(self.decoded)
        self.decoded += self._stream.step(self._backend, token) or ""
        cut = self._first_stop(searched)
        if cut is not None:
            self.finish_reason = "stop"
            return self._release(self.decoded[:cut])
        return self._release(self.decoded[: len(self.decoded) - self._held()])

    def finish(self, reason: str = "length") -> str:
        """The text ends here (EOS, or the generation stopped): release what was held back."""
        if self.finish_reason is not None:
            return ""
        self.finish_reason = reason
        return self._release(self.decoded)

    def _first_stop(self, searched: int) -> int | None:
        """Where the earliest stop string begins, looking only where new text could complete one."""
        cuts = []
        for stop in self.stops:
            at = self.decoded.find(stop, max(0, searched - len(stop) + 1))
            if at >= 0:
                cuts.append(at)
        return min(cuts) if cuts else None

    def _held(self) -> int:
        """How many trailing characters could still begin a stop string."""
        held = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.decoded)), held, -1):
                if self.decoded.endswith(stop[:size]):
                    held = size
                    break
        return held

    def _release(self, text: str) -> str:
        delta = text[len(self.released) :]
        self.released = text
        return delta
