"""Token generation over an inference session: embed -> swarm -> head -> sample, one token per step.

`generate_steps` is an async generator yielding each step's new tokens [B] (with their log-probabilities
when asked for) as soon as they are chosen, so callers stream them. Rows that hit an EOS token or a stop
string are finished and padded until every row is done. The last sampled token is left in
`session.pending_token_ids`, so a later call on the same session continues the conversation without
recomputing anything. With speculative decoding (client/speculative.py) a step through the swarm may
yield several tokens, each one exactly the token this loop would have chosen.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from corolla.client.constraints import Constraint
from corolla.client.head_batcher import HeadBatcher
from corolla.client.inference_session import InferenceSession
from corolla.client.sampling import SamplingParams, next_tokens, top_logprobs
from corolla.client.speculative import Speculation, speculate
from corolla.client.spot_checks import Rewound
from corolla.client.text import IncrementalText
from corolla.errors import InvalidRequest, ServerUnavailable


@dataclass(frozen=True)
class GenerationStep:
    tokens: torch.Tensor  # [B] the chosen tokens (pad_token_id in rows that had already finished)
    finished: torch.Tensor  # [B] bool: rows done after this step (EOS or a stop string)
    logprobs: torch.Tensor | None = None  # [B] the chosen tokens' log-probabilities (params.logprobs set)
    top_values: torch.Tensor | None = None  # [B, k] the k most likely tokens' log-probabilities
    top_ids: torch.Tensor | None = None  # [B, k] and their ids
    # a spot check caught a server lying: the last `withdrawn` steps yielded are void (tokens is empty);
    # the steps that follow replace them
    withdrawn: int = 0


class RowEnds:
    """Which rows have ended: at an EOS token, or (with a tokenizer) once their text holds a stop string."""

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int], tokenizer: Any, batch_size: int):
        if (params.stop or params.grammar) and tokenizer is None:
            raise InvalidRequest("stop strings and grammars need a tokenizer, and this model folder has none")
        self.eos = torch.tensor([] if params.ignore_eos else list(eos_token_ids), dtype=torch.long)
        self.params, self.tokenizer, self.batch_size = params, tokenizer, batch_size
        self.reset()

    def reset(self) -> None:
        stop, size = self.params.stop, self.batch_size
        texts = [IncrementalText(self.tokenizer, stop) for _ in range(size)] if stop else []
        self.texts = texts  # the one detokenizer (client/text.py), only where stop strings need the text
        self.finished = torch.zeros(size, dtype=torch.bool)

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
    with the request's own generator), keeps the text so far and which rows have ended."""

    def __init__(self, params: SamplingParams, ends: RowEnds, pad_token_id: int, input_ids: torch.Tensor):
        self.params, self.ends, self.pad_token_id = params, ends, pad_token_id
        self.generator = params.make_generator() if params.do_sample else None
        self.context, self.prompt_length = input_ids, input_ids.shape[1]  # [B, T]: prompt + chosen tokens
        self.num_chosen = 0
        self.states: list[torch.Tensor] = []  # the generator's state before each choice (for rewinds)
        self.constraint = None
        if params.grammar is not None:
            rows = input_ids.shape[0]
            self.constraint = Constraint(params.grammar, ends.tokenizer, ends.eos.tolist(), rows)

    @property
    def done(self) -> bool:
        return bool(self.ends.finished.all()) or self.num_chosen >= self.params.max_new_tokens

    def choose(self, logits: torch.Tensor) -> GenerationStep:
        """logits [B, vocab] after the text so far -> the next token of every row."""
        params, context = self.params, self.context
        if self.generator is not None:
            self.states.append(self.generator.get_state())
        active = ~self.ends.finished
        allowed = logits if self.constraint is None else self.constraint.mask(logits, active)
        tokens = next_tokens(allowed, context, params, self.generator, context[:, self.prompt_length :])
        tokens = torch.where(active, tokens, torch.full_like(tokens, self.pad_token_id))
        if self.constraint is not None:
            self.constraint.advance(tokens, active)
        self.context = torch.cat([context, tokens[:, None]], dim=1)
        self.num_chosen += 1
        finished = self.ends.update(tokens)
        if params.logprobs is None:
            return GenerationStep(tokens, finished)
        return GenerationStep(tokens, finished, *top_logprobs(logits, tokens, params.logprobs))

    def rewind(self, keep: int) -> int:
        """Forget every choice after the first `keep`; returns how many were forgotten."""
        withdrawn, self.num_chosen = self.num_chosen - keep, keep
        self.context = self.context[:, : self.prompt_length + keep]
        if self.generator is not None:
            self.generator.set_state(self.states[keep])
            del self.states[keep:]
        if self.constraint is not None:
            self.constraint.replay(self.context[:, self.prompt_length :], self.ends)
            return withdrawn
        self.ends.reset()
        for tokens in self.context[:, self.prompt_length :].T:
            self.ends.update(tokens)
        return withdrawn


async def generate_steps(  # noqa: PLR0913
    head: HeadBatcher,
    session: InferenceSession,
    input_ids: torch.Tensor,
    params: SamplingParams,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    tokenizer: Any = None,
    tuned: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    speculation: Speculation | None = None,
) -> AsyncIterator[GenerationStep]:
    """Yield every row's next token, up to params.max_new_tokens steps.

    `tuned` (a new session only): trained prompts, (input prefix [B, P, H], deep prompts or None); the
    prefix goes before the first step's inputs and the deep prompts to the servers with it (they keep
    them for the session). With `speculation` (a batch of one row), each step verifies a draft and may
    yield several tokens: the same tokens, one at a time.
    """
    inputs = _first_inputs(session, input_ids, params, tuned)
    chooser = Chooser(
        params, RowEnds(params, eos_token_ids, tokenizer, input_ids.shape[0]), pad_token_id, input_ids
    )
    head.register()  # lets the head batcher know how many sessions may join a batch
    try:
        with torch.no_grad():
            hidden = head.head.embed(inputs)  # [B, T, H]
            deep = None
            if tuned is not None:
                hidden, deep = torch.cat([tuned[0].to(hidden.dtype), hidden], dim=1), tuned[1]
            first = _FirstStep(session.position, hidden, deep)
            resume = first.start
            while True:
                try:
                    async for step in _decode(head, session, chooser, speculation, first, resume):
                        yield step
                    await session.averify()  # with spot checks: the last tokens are checked too
                    return
                except Rewound as rewound:  # a server lied: repaired; go back to the first wrong token
                    resume = rewound.position
                    yield GenerationStep(
                        torch.empty(0), chooser.ends.finished, withdrawn=first.rewind(resume, chooser)
                    )
    finally:
        head.unregister()


@dataclass(frozen=True)
class _FirstStep:
    """A generation's first step (prefix, pending token and prompt), kept to go back into it."""

    start: int  # the session's position before it
    hidden: torch.Tensor  # [B, T, H]
    deep: torch.Tensor | None

    @property
    def end(self) -> int:
        return self.start + self.hidden.shape[1]

    def rewind(self, position: int, chooser: Chooser) -> int:
        """The chooser back to the choices made before `position` was fed; returns how many it forgot."""
        if position < self.start:
            raise ServerUnavailable(
                f"a spot check caught a server computing wrong outputs at position {position}, before this "
                "generation's start: the session's earlier turns cannot be redone; start a new session"
            )
        # the token fed at `position` (a chosen one, at or after `end`) was chosen from the output before it
        return chooser.rewind(max(position - self.end + 1, 0))


async def _decode(  # noqa: PLR0913
    head: HeadBatcher,
    session: InferenceSession,
    chooser: Chooser,
    speculation: Speculation | None,
    first: _FirstStep,
    position: int,
) -> AsyncIterator[GenerationStep]:
    """Decode from `position` (the first step's start, or a rewind's position) until the chooser is done."""
    if position < first.end:  # (again) the first step, or its part from `position`
        deep = first.deep if position == first.start else None
        outputs = await session.astep(
            first.hidden[:, position - first.start :], deep, start_from_position=position
        )
    else:  # the chosen token fed at `position`, again
        token = chooser.context[:, -1:]
        outputs = await session.astep(head.head.embed(token), start_from_position=position)
    while True:
        logits = await head.logits(outputs[:, -1])  # [B, vocab], batched with other sessions'
        step = chooser.choose(logits)
        session.pending_token_ids = step.tokens[:, None]
        yield step
        if chooser.done:
            return
        if speculation is not None and chooser.context.shape[0] == 1:
            async for step in speculate(head, session, chooser, speculation):
                yield step
            return
        outputs = await session.astep(head.head.embed(step.tokens[:, None]))


def _first_inputs(
    session: InferenceSession,
    input_ids: torch.Tensor,
    params: SamplingParams,
    tuned: tuple[torch.Tensor, torch.Tensor | None] | None,
) -> torch.Tensor:
    """The first step's token ids (after the session's pending token), checked against its limits."""
    inputs = input_ids
    pending = session.pending_token_ids
    if pending is not None:
        if pending.shape[0] != input_ids.shape[0]:
            batch = input_ids.shape[0]
            raise InvalidRequest(f"batch size {batch} differs from the session's {pending.shape[0]}")
        inputs = torch.cat([pending, input_ids], dim=1)
    prefix_length = 0 if tuned is None else tuned[0].shape[1]
    if tuned is not None and session.position > 0:
        raise InvalidRequest("trained prompts apply from a session's start; this session has already begun")
    needed = session.position + prefix_length + inputs.shape[1] + params.max_new_tokens - 1
    if needed > session.max_length:
        raise InvalidRequest(
            f"{inputs.shape[1]} input tokens + {params.max_new_tokens} new tokens at position "
            f"{session.position} exceed the session's max_length={session.max_length}"
        )
    return inputs
