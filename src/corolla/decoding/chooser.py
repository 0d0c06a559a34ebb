"""Choosing each next token from logits: the one rule plain decoding and speculation both follow.

`Chooser` owns a generation's sampler state (its generator), the text so far, the grammar's matchers and
which rows have ended; `RowEnds` tells when a row ends (an EOS token, or a stop string in its text).
A rewind (a spot check withdrew tokens) puts all of it back as it was after the choices kept, so the
same tokens are chosen again from the same logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from corolla.decoding.constraints import Constraint
from corolla.decoding.sampling import SamplingParams, pick, processed_scores, top_logprobs
from corolla.decoding.text import IncrementalText
from corolla.errors import InvalidRequest


@dataclass(frozen=True)
class GenerationStep:
    tokens: torch.Tensor  # [B] the chosen tokens (pad_token_id in rows that had already finished)
    finished: torch.Tensor  # [B] bool: rows done after this step (EOS or a stop string)
    logprobs: torch.Tensor | None = None  # [B] the chosen tokens' log-probabilities (params.logprobs set)
    top_values: torch.Tensor | None = None  # [B, k] the k most likely tokens' log-probabilities
    top_ids: torch.Tensor | None = None  # [B, k] and their ids
    scores: torch.Tensor | None = None  # [B, V] what the tokens were chosen from (params.output_scores)
    logits: torch.Tensor | None = None  # [B, V] the model's raw logits (params.output_logits)
    # a spot check caught a server lying: the last `withdrawn` steps yielded are void (tokens is empty);
    # the steps that follow replace them
    withdrawn: int = 0
    # on a generation's first step: the prompt's positions its servers held already (reused prefixes)
    cached_tokens: int | None = None
    # the chain that computed it (client/model.py fills it in): a Hop (peer_id, start, end) per server
    route: tuple[Any, ...] = ()


class RowEnds:
    """Which rows have ended: at an EOS token, or (with a tokenizer) once their text holds a stop string."""

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int], tokenizer: Any, batch_size: int):
        if (params.stop or params.grammar) and tokenizer is None:
            raise InvalidRequest("stop strings and grammars need a tokenizer, and this model folder has none")
        self.eos = torch.tensor([] if params.ignore_eos else list(eos_token_ids), dtype=torch.long)
        self.params = params
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.reset()

    def reset(self) -> None:
        stop = self.params.stop
        size = self.batch_size
        texts = [IncrementalText(self.tokenizer, stop) for _ in range(size)] if stop else []
        self.texts = texts  # the one detokenizer (decoding/text.py), only where stop strings need the text
        self.finished = torch.zeros(size, dtype=torch.bool)

    def stop(self, rows: torch.Tensor) -> torch.Tensor:
        """End these rows [B] (a caller's stopping criterion said so); returns which rows are finished."""
        self.finished = self.finished | rows
        return self.finished

    def update(self, tokens: torch.Tensor) -> torch.Tensor:
        """Record one step's tokens [B]; returns which rows are finished now."""
        self.finished = self.finished | torch.isin(tokens, self.eos)
        if self.texts:
            for text, token in zip(self.texts, tokens.tolist(), strict=True):
                text.add(token)
            self.finished = self.finished | torch.tensor([t.finish_reason == "stop" for t in self.texts])
        return self.finished


class Chooser:
    """Chooses each row's next token from logits as transformers' `generate` would (penalties, sampling
    with the request's own generator, the request's grammar), keeps the text so far and which rows have
    ended."""

    def __init__(self, params: SamplingParams, ends: RowEnds, pad_token_id: int, input_ids: torch.Tensor):
        self.params = params
        self.ends = ends
        self.pad_token_id = pad_token_id
        self.generator = params.make_generator() if params.do_sample else None
        self.context = input_ids  # [B, T]: prompt + chosen tokens
        self.prompt_length = input_ids.shape[1]
        self.num_chosen = 0
        self.states: list[torch.Tensor] = []  # the generator's state before each choice (for rewinds)
        self.constraint = None
        if params.grammar is not None:
            rows = input_ids.shape[0]
            self.constraint = Constraint(params.grammar, ends.tokenizer, ends.eos.tolist(), rows)

    @property
    def done(self) -> bool:
        return bool(self.ends.finished.all()) or self.num_chosen >= self.params.max_new_tokens

    @property
    def chosen(self) -> torch.Tensor:
        """[B, num_chosen]: the tokens chosen so far."""
        return self.context[:, self.prompt_length :]

    def choose(self, logits: torch.Tensor) -> GenerationStep:
        """logits [B, vocab] after the text so far -> the next token of every row."""
        params = self.params
        context = self.context
        logits = logits.cpu()  # a head on an accelerator: choices are made here, beside the context
        if self.generator is not None:
            self.states.append(self.generator.get_state())
        active = ~self.ends.finished
        allowed = logits if self.constraint is None else self.constraint.mask(logits, active)
        scores = processed_scores(allowed, context, params, self.chosen)
        tokens = pick(scores, params, self.generator)
        tokens = torch.where(active, tokens, torch.full_like(tokens, self.pad_token_id))
        if self.constraint is not None:
            self.constraint.advance(tokens, active)
        self.context = torch.cat([context, tokens[:, None]], dim=1)
        self.num_chosen += 1
        finished = self.ends.update(tokens)
        for criterion in params.stopping_criteria:  # transformers' StoppingCriteria: [B] bools
            finished = self.ends.stop(torch.as_tensor(criterion(self.context, logits), dtype=torch.bool))
        logprobs = (None,) * 3 if params.logprobs is None else top_logprobs(logits, tokens, params.logprobs)
        return GenerationStep(
            tokens,
            finished,
            *logprobs,
            scores=scores if params.output_scores else None,
            logits=logits.float() if params.output_logits else None,
        )

    def rewind(self, keep: int) -> int:
        """Forget every choice after the first `keep`; returns how many were forgotten."""
        withdrawn = self.num_chosen - keep
        self.num_chosen = keep
        self.context = self.context[:, : self.prompt_length + keep]
        if self.generator is not None:
            self.generator.set_state(self.states[keep])
            del self.states[keep:]
        self.ends.reset()
        if self.constraint is not None:
            self.constraint.reset()
        for tokens in self.chosen.T:  # the kept choices again: row ends, stop-string text, grammar
            if self.constraint is not None:
                self.constraint.advance(tokens, ~self.ends.finished)
            self.ends.update(tokens)
        return withdrawn
