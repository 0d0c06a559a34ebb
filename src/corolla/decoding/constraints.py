"""Constrained decoding: a grammar each row's output must match, enforced where sampling happens.

The grammar library is llguidance (the Rust engine vLLM, SGLang and llama.cpp use): a grammar is its
serialized form (from a JSON schema or a Lark grammar, which may embed JSON schemas with `%json`), and
an `LLMatcher` per row computes which tokens may come next, in microseconds per token. Masking happens
on the client before the sampling step (`Chooser`), so every server of the swarm serves constrained
requests unchanged, and batching, speculation (a draft token the grammar forbids is simply rejected),
stop strings, seeds and rewinds compose with it. Grammars are checked when a request arrives: a bad
schema is the caller's error, named.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from corolla.decoding.json_bounds import bounded_schema
from corolla.errors import InvalidRequest

logger = logging.getLogger(__name__)

# JSON as models write it: one space after separators, no other whitespace (a model free to add
# whitespace may add it forever)
JSON_OPTIONS: llguidance.JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def json_schema_grammar(schema: dict[str, Any] | bool, max_tokens: int | None = None) -> str:
    """The grammar of JSON matching `schema` (True or {} for any JSON value), with the bounds it leaves open
    filled in to fit `max_tokens` (decoding/json_bounds.py); raises InvalidRequest."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    schema = bounded_schema(schema, max_tokens)
    return checked(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))


def lark_grammar(lark: str) -> str:
    """A Lark grammar (llguidance's dialect: `%json {schema}` embeds a JSON schema); raises InvalidRequest."""
    return checked(llguidance.LLMatcher.grammar_from_lark(lark))


def checked(grammar: str) -> str:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidRequest(f"the grammar is invalid: {messages[0]}")
    return grammar


_BUILDING = threading.Lock()


def grammar_tokenizer(hf_tokenizer: Any, vocab_size: int, eos: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer: about 0.35 s to build for a 49k vocabulary, so built once (the
    API builds it in a thread at start, `warm`, rather than on the model's loop at the first request)."""
    with _BUILDING:
        return _tokenizer(hf_tokenizer, vocab_size, tuple(eos))


def warm(hf_tokenizer: Any, vocab_size: int, eos: Sequence[int]) -> None:
    """Build the tokenizer's view in a background thread (a tokenizer it cannot read is left for the
    first constrained request to report)."""

    def build() -> None:
        try:
            grammar_tokenizer(hf_tokenizer, vocab_size, eos)
        except Exception as e:
            logger.info("Constrained decoding will not work with this tokenizer: %s", e)

    threading.Thread(target=build, name="grammar-tokenizer", daemon=True).start()


@functools.lru_cache(maxsize=8)
def _tokenizer(hf_tokenizer: Any, vocab_size: int, eos: tuple[int, ...]) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos))


class Constraint:
    """One matcher per row of a generation; masks logits and follows the chosen tokens."""

    def __init__(self, grammar: str, hf_tokenizer: Any, eos_token_ids: Sequence[int], rows: int):
        if hf_tokenizer is None:
            raise InvalidRequest("constrained decoding needs a tokenizer, and this model folder has none")
        self.grammar = grammar
        self.hf_tokenizer = hf_tokenizer
        self.eos = tuple(eos_token_ids)
        self.rows = rows
        self.matchers: list[llguidance.LLMatcher] = []

    def _start(self, vocab_size: int) -> None:
        tokenizer = grammar_tokenizer(self.hf_tokenizer, vocab_size, self.eos)
        first = llguidance.LLMatcher(tokenizer, self.grammar)  # compiled once, copied for the other rows
        self.matchers = [first, *(first.deep_copy() for _ in range(self.rows - 1))]
        self.words = (vocab_size + 31) // 32
        self.bits = torch.zeros(self.rows, self.words, dtype=torch.int32)
        for matcher in self.matchers:
            if matcher.is_error():
                raise InvalidRequest(f"the grammar is invalid: {matcher.get_error()}")

    def mask(self, logits: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """logits [B, V] with the tokens each active row's grammar forbids set to -inf."""
        if not self.matchers:
            self._start(logits.shape[-1])
        self.bits.fill_(-1)  # rows not constrained (finished) allow everything
        for row, matcher in enumerate(self.matchers):
            if bool(active[row]):
                matcher.unsafe_compute_mask_ptr(self.bits[row].data_ptr(), self.words * 4)
        bits = np.unpackbits(self.bits.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits[:, : logits.shape[-1]]).bool().to(logits.device)
        return logits.masked_fill(~allowed, -torch.inf)

    def advance(self, tokens: torch.Tensor, active: torch.Tensor) -> None:
        """Each active row's matcher follows the token chosen for it (one the mask allowed)."""
        for row, matcher in enumerate(self.matchers):
            if bool(active[row]) and not matcher.consume_token(int(tokens[row])):
                raise InvalidRequest(f"constrained decoding failed: {matcher.get_error()}")

    def reset(self) -> None:
        """Every row's matcher back to the grammar's start (a rewind then replays the kept tokens)."""
        for matcher in self.matchers:
            matcher.reset()
