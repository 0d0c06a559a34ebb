"""Token generation over an inference session: the one decode loop, for `generate`, streams and the API.

`generate_steps` yields each step's chosen tokens as soon as they are chosen. Its rounds are plain (one
token fed, one chosen) or speculative (client/generation/speculative.py: a draft verified in one step, several
tokens, the same ones). Between rounds, spot checks run (client/checks/spot_checks.py); a verdict repairs the
session (back to the first wrong position, the liar replaced) and withdraws the tokens chosen from wrong
outputs. This loop is the only place that decides what a withdrawal means: with `withdrawals="redo"`
(`generate`, non-streamed API answers) it yields a step that withdraws them and decodes them again;
with "fail" (streams, whose tokens are already out) it raises ServerUnavailable.

It is also the only writer of `session.pending_token_ids`: the last chosen token, not yet fed, so a
later call on the same session continues the conversation without recomputing anything.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

import torch

from corolla.client.chain.session import InferenceSession
from corolla.client.checks.spot_checks import SpotChecker, Verdict
from corolla.client.generation.head_batcher import HeadBatcher
from corolla.client.generation.pipelined import pipelined_steps
from corolla.client.generation.speculative import speculative_round
from corolla.decoding.chooser import Chooser, GenerationStep
from corolla.decoding.sampling import SamplingParams
from corolla.decoding.speculator import Speculation
from corolla.errors import RETRYABLE, InvalidRequest, ServerUnavailable

Withdrawals = Literal["redo", "fail"]


@dataclass(frozen=True)
class FirstStep:
    """A generation's first step (trained prefix, pending token and prompt), kept to go back into it."""

    start: int  # the session's position before it
    hidden: torch.Tensor  # [B, T, H]
    deep: torch.Tensor | None  # deep prompts, sent with it when it starts the session
    held: int = 0  # its first positions the servers already hold (a fork's: generation/prefixes.py): not sent

    @property
    def end(self) -> int:
        return self.start + self.hidden.shape[1]


def first_step(
    head: HeadBatcher,
    session: InferenceSession,
    input_ids: torch.Tensor,
    params: SamplingParams,
    tuned: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    held: int = 0,
) -> FirstStep:
    """The first step of generating after `input_ids` [B, T] on `session` (after its pending token),
    checked against the session's limits. `tuned` (a new session only): trained prompts, (input prefix
    [B, P, H], deep prompts or None); `held`: the first positions of a new session that its servers hold
    already (forked from another session's), fed again only if a spot check rewinds into them."""
    inputs = input_ids
    pending = session.pending_token_ids
    if pending is not None:
        if pending.shape[0] != input_ids.shape[0]:
            batch = input_ids.shape[0]
            raise InvalidRequest(f"batch size {batch} differs from the session's {pending.shape[0]}")
        inputs = torch.cat([pending, input_ids], dim=1)
    if tuned is not None and session.position > 0:
        raise InvalidRequest("trained prompts apply from a session's start; this session has already begun")
    prefix_length = 0 if tuned is None else tuned[0].shape[1]
    start = session.position - held
    needed = start + prefix_length + inputs.shape[1] + params.max_new_tokens - 1
    if needed > session.max_length:
        raise InvalidRequest(
            f"{inputs.shape[1]} input tokens + {params.max_new_tokens} new tokens at position "
            f"{start} exceed the session's max_length={session.max_length}"
        )
    with torch.no_grad():
        hidden = head.head.embed(inputs)  # [B, T, H]
    if tuned is None:
        return FirstStep(start, hidden, None, held)
    return FirstStep(start, torch.cat([tuned[0].to(hidden.dtype), hidden], dim=1), tuned[1])


async def generate_steps(
    head: HeadBatcher,
    session: InferenceSession,
    chooser: Chooser,
    first: FirstStep,
    speculation: Speculation | None = None,
    checker: SpotChecker | None = None,
    withdrawals: Withdrawals = "redo",
) -> AsyncIterator[GenerationStep]:
    """Yield every row's next token until the chooser is done (max_new_tokens, or every row ended).
    With `speculation` (a batch of one row), a round may yield several tokens: the same tokens."""
    loop = _Loop(head, session, chooser, first, speculation, checker, withdrawals)
    head.register()  # lets the head batcher know how many sessions may join a batch
    try:
        with torch.no_grad():
            async for step in loop.steps():
                yield step
    finally:
        head.unregister()


@dataclass
class _Loop:
    head: HeadBatcher
    session: InferenceSession
    chooser: Chooser
    first: FirstStep
    speculation: Speculation | None
    checker: SpotChecker | None
    withdrawals: Withdrawals

    async def steps(self) -> AsyncIterator[GenerationStep]:
        # a position to feed again from (the start after what the servers hold, or a rewind's)
        resume: int | None = self.first.start + self.first.held
        while True:
            if resume is not None:
                steps = _each(await self._resume(resume))
                resume = None
            else:
                verdict = await self._check(final=self.chooser.done)
                if verdict is not None:
                    resume, withdrawn = await self._withdraw(verdict)
                    yield GenerationStep(torch.empty(0), self.chooser.ends.finished, withdrawn=withdrawn)
                    continue
                if self.chooser.done:
                    return
                steps = self._round()
            async for step in steps:
                self.session.pending_token_ids = step.tokens[:, None]
                yield step

    async def _resume(self, position: int) -> GenerationStep:
        """Feed from `position` again: the first step (or its part from `position`), or the token chosen
        for `position`; then choose the next token."""
        first = self.first
        session = self.session
        if position < first.end:
            deep = first.deep if position == first.start else None
            hidden = first.hidden[:, position - first.start :]
            outputs = await session.astep(hidden, deep, start_from_position=position)
        else:
            token = self.chooser.context[:, -1:]
            outputs = await session.astep(self.head.head.embed(token), start_from_position=position)
        step = self.chooser.choose(await self.head.logits(outputs[:, -1]))  # [B, vocab], batched
        if self.speculation is not None:  # the text's first token is at first.end - prompt_length
            index = position - (first.end - self.chooser.prompt_length)
            self.speculation.observe(index, outputs[0], self.chooser.context[0])
        return step

    async def _round(self) -> AsyncIterator[GenerationStep]:
        """One round's tokens: a plain step's one, or a speculative round's (pipelined: as each is chosen)."""
        speculation = self.speculation
        if speculation is None or self.chooser.context.shape[0] != 1:
            outputs = await self.session.astep(self.head.head.embed(self.chooser.context[:, -1:]))
            yield self.chooser.choose(await self.head.logits(outputs[:, -1]))
            return
        choice = speculation.choice
        started = time.perf_counter()
        depth = choice.depth()  # frames in flight; a pipelined round measures itself, in segments
        if depth > 1:
            # spot checks run between rounds: a round then ends at its first rejected draft
            steps = pipelined_steps(
                self.head, self.session, self.chooser, speculation, depth, self.checker is not None
            )
            try:
                async for step in steps:
                    yield step
                return
            except RETRYABLE:  # a server failed before anything was chosen: a step that fails over
                started = time.perf_counter()
        for step in (steps := await speculative_round(self.head, self.session, self.chooser, speculation)):
            yield step
        choice.record(1, len(steps), time.perf_counter() - started)

    async def _check(self, final: bool) -> Verdict | None:
        """Spot checks between rounds: the hops due now, or every hop once the generation is done."""
        if self.checker is None:
            return None
        return await self.checker.check(self.session, every_hop=final)

    async def _withdraw(self, verdict: Verdict) -> tuple[int, int]:
        """Repair the session and forget the choices made from wrong outputs: (where to feed again from,
        how many tokens were withdrawn)."""
        await self.session.arepair(verdict.position, verdict.faulty)
        position = verdict.position
        first = self.first
        if position < first.start:
            raise ServerUnavailable(
                f"a spot check caught a server computing wrong outputs at position {position}, before this "
                "generation's start: the session's earlier turns cannot be redone; start a new session"
            )
        # the token fed at `position` (a chosen one, at or after `end`) was chosen from the output before it
        withdrawn = self.chooser.rewind(max(position - first.end + 1, 0))
        self.session.pending_token_ids = self.chooser.context[:, -1:] if position >= first.end else None
        if self.withdrawals == "fail":
            raise ServerUnavailable(
                f"a spot check caught a server computing wrong outputs: the last {withdrawn} tokens "
                "streamed were wrong (the server is banned; generate again)"
            )
        return position, withdrawn


async def _each(*steps: GenerationStep) -> AsyncIterator[GenerationStep]:
    for step in steps:
        yield step
