"""Pipelined speculation: drafts stream into the chain as frames while earlier frames are still verified.

A synchronous speculative round (client/generation/speculative.py) sends a draft and waits a whole round trip
for its verification before the next draft goes out, so across the internet every server idles most of
the time. Here the drafter keeps going on the assumption that its drafts are right: the root (the last
chosen token) goes out as a frame (client/chain/frames.py) as soon as it is known, then each chain of drafted
tokens (`frame_tokens` of them) as the next frame at the positions after, up to `depth` frames in flight.
Each frame's logits are verified as soon as they come back, in order, with the one Chooser rule (so
greedy and seeded sampling give exactly the tokens of plain decoding), and each token is yielded as soon
as it is chosen: the token chosen after each position must be the token sent at the next one.

The first one that is not starts a new epoch: the chosen token is the new root, sent at once at its
position (a rollback: servers drop what the frames after it left), the frames of the old epoch still in
flight are read and dropped, and so is the draft being made. The drafter then drafts after the new root.
A round ends when the text does, when a server fails (with what was verified: the next round is a
synchronous one, whose chain fails over: client/generation/loop.py), when the drafter has nothing to guess
and nothing is in flight, or (`stop_at_rejection`, when spot checks run between rounds) at a rejection.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import torch

from corolla.client.chain.frames import FramePipe
from corolla.client.chain.session import InferenceSession
from corolla.client.generation.head_batcher import HeadBatcher
from corolla.decoding.chooser import Chooser, GenerationStep
from corolla.decoding.round_choice import SEGMENT_TOKENS, RoundChoice
from corolla.decoding.speculator import Speculation
from corolla.errors import RETRYABLE


@dataclass
class _InFlight:
    epoch: int
    first: int  # the index in its epoch's tokens of its first token
    length: int
    outputs: asyncio.Future  # the last hop's outputs [1, T, H]


class _Round:
    def __init__(
        self,
        head: HeadBatcher,
        session: InferenceSession,
        chooser: Chooser,
        speculation: Speculation,
        stop_at_rejection: bool,
    ):
        self.head = head
        self.chooser = chooser
        self.speculation = speculation
        self.stop_at_rejection = stop_at_rejection
        self.finished = False
        self.start = session.position  # where the round's first root goes
        self.limit = min(session.max_length - self.start, chooser.params.max_new_tokens - chooser.num_chosen)
        self.chosen = 0  # tokens chosen in this round; the last one is the root of the current epoch
        self.epoch = 0
        self.base = 0  # where the epoch's tokens start, from `start`
        self.context = chooser.context[0].tolist()  # the text up to the epoch's root
        self.tokens = self.context[-1:]  # the epoch's root and drafted tokens, sent or being sent
        self.unsent = 1  # of them, those not sent yet
        self.inflight: deque[_InFlight] = deque()
        self.drafting: asyncio.Future | None = None  # (its epoch, its tokens)
        # drafted tokens a choice was compared with (a dropped epoch's others were never verified)
        self.compared = self.frames = self.most_in_flight = 0

    def new_epoch(self, root: int) -> None:
        """A token the drafts did not have: the next epoch starts from it (its frames are sent after what
        the servers hold of the old one, which the first of them rolls back)."""
        self.epoch += 1
        self.base = self.chosen
        self.context = self.chooser.context[0].tolist()
        self.tokens = [root]
        self.unsent = 1

    @property
    def room(self) -> int:
        """Tokens that may still be drafted in this round."""
        return self.limit - self.base - len(self.tokens)

    def want_draft(self) -> bool:
        """Whether to draft on now: nothing is being drafted, no draft waits to be sent, and there is room."""
        return self.drafting is None and self.unsent <= 1 and self.room > 0

    def start_draft(self, frame: int) -> None:
        """Draft the next frame's `frame` tokens (fewer where the round has less room)."""
        epoch = self.epoch
        drafted = self.speculation.draft_chain([*self.context, *self.tokens[1:]], min(self.room, frame))
        self.drafting = asyncio.ensure_future(_tagged(epoch, drafted))

    def took_draft(self) -> bool:
        """Whether the finished draft is of this epoch and drafted anything (its tokens are then to send)."""
        epoch, draft = self.drafting.result()
        self.drafting = None
        if epoch != self.epoch or not draft:
            return False
        self.tokens += draft
        self.unsent += len(draft)
        return True

    async def event(self) -> _InFlight | bool:
        """What to act on next: True, a draft was taken (to send); a frame whose reply is in (to verify; when
        the walk would reach the last token, once the draft after it is in too); False, nothing is left to
        wait for. A failed frame raises."""
        while self.inflight or self.drafting is not None:
            oldest = self.inflight[0] if self.inflight else None
            if oldest is not None and oldest.outputs.done() and not self._reaches_draft(oldest):
                self.inflight.popleft()
                oldest.outputs.result()  # a failure raises here
                return oldest
            ready = oldest is not None and oldest.outputs.done()  # then only the draft is awaited
            waiting = [f for f in (self.drafting, None if ready else oldest and oldest.outputs) if f]
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if self.drafting is not None and self.drafting.done() and self.took_draft():
                return True
        return False

    def _reaches_draft(self, sent: _InFlight) -> bool:
        """Whether the walk of `sent` would reach past the tokens known while a draft after them is being
        made: its last choice is then checked against that draft."""
        at_end = sent.epoch == self.epoch and sent.first + sent.length >= len(self.tokens)
        return at_end and self.drafting is not None

    def verify(self, sent: _InFlight, logits: torch.Tensor) -> Iterator[GenerationStep]:
        """Choose after each of a frame's tokens, one at a time, while each choice is the token sent next; a
        choice that is not starts a new epoch (or ends the round)."""
        for i in range(logits.shape[0]):
            step = self.chooser.choose(logits[i : i + 1])
            self.chosen += 1
            yield step
            following = sent.first + i + 1  # the choice must be the token sent there
            token = int(step.tokens[0])
            if self.chooser.done:
                self.finished = True
                return
            self.compared += following < len(self.tokens)
            if following >= len(self.tokens) or self.tokens[following] != token:
                self.finished = self.stop_at_rejection
                self.new_epoch(token)
                return

    async def send(self, pipe: FramePipe) -> None:
        """The epoch's unsent tokens as one frame."""
        first = len(self.tokens) - self.unsent
        hidden = self.head.head.embed(torch.tensor([self.tokens[first:]]))
        length = self.unsent
        self.unsent = 0
        outputs = await pipe.send(hidden, self.start + self.base + first)
        self.inflight.append(_InFlight(self.epoch, first, length, outputs))
        self.frames += 1
        self.most_in_flight = max(self.most_in_flight, len(self.inflight))


class _Segment:
    """The tokens and seconds of a pipelined round since its last segment, told to the RoundChoice at a
    rejection once there are SEGMENT_TOKENS of them (where ending the round wastes no frame), with the
    frames in flight it ran at; the choice then says how many the next segment keeps in flight."""

    def __init__(self, choice: RoundChoice, depth: int):
        self.choice = choice
        self.depth = depth  # frames in flight
        self.chosen = 0  # the round's tokens before this segment
        self.started = time.perf_counter()

    def goes_on(self, chosen: int) -> bool:
        """At a rejection, with `chosen` tokens in the round: whether the round goes on pipelined (at the
        depth chosen now; the tokens verified after an end count at the depth they were sent at)."""
        if chosen - self.chosen < SEGMENT_TOKENS:
            return True
        self.end(chosen)
        depth = self.choice.depth()
        if depth > 1:
            self.depth = depth
        return depth > 1

    def end(self, chosen: int) -> None:
        now = time.perf_counter()
        self.choice.record(self.depth, chosen - self.chosen, now - self.started)
        self.chosen = chosen
        self.started = now


async def _verified(
    run: _Round, sent: _InFlight, head: HeadBatcher, segment: _Segment
) -> AsyncIterator[GenerationStep]:
    """A frame's tokens, as each is chosen; at a rejection that ends a segment, the round ends if
    synchronous rounds are measured faster."""
    outputs = sent.outputs.result()[0]
    logits = await head.logits(outputs)  # [tokens, vocab]
    epoch = run.epoch
    index = len(run.context) - 1 + sent.first  # the frame's first token, in the text
    chosen = run.chosen
    for step in run.verify(sent, logits):
        yield step
    run.speculation.observe(index, outputs[: run.chosen - chosen], run.chooser.context[0])
    if run.epoch != epoch and not segment.goes_on(run.chosen):
        run.finished = True


def frame_tokens(max_depth: int, in_flight: int) -> int:
    """The drafted tokens a frame carries: the frames in flight carry about what a synchronous draft
    would (`max_depth`) between them, so each goes out as soon as its few tokens are drafted (a frame
    of max_depth waited for its last token before its first was sent) and a rejection drops about a
    synchronous draft's worth. bench/wan/speculative_wan.py (SmolLM2, an int8 copy drafting at ~50 ms a
    token), frames of 8 against frames of 3, one run each (bench/results/speculative_wan_frames_of_*.json):
    on loopback pipelined drafts 0.91x -> 1.02x plain push, pipelined lookup 0.90x -> 1.03x; at 50 ms round
    trips 2.46x -> 2.54x and 1.32x -> 1.34x."""
    return max(1, math.ceil(max_depth / in_flight))


async def _tagged(epoch: int, work) -> tuple[int, list[int]]:
    return epoch, await work


async def pipelined_steps(
    head: HeadBatcher,
    session: InferenceSession,
    chooser: Chooser,
    speculation: Speculation,
    depth: int,
    stop_at_rejection: bool = False,
) -> AsyncIterator[GenerationStep]:
    """Frames through the swarm after the last chosen token (not yet fed), at most `depth` in flight (then
    as many as the round's choice says at each segment); each token chosen, as soon as it is (exactly those
    of plain decoding). A failure raises only if nothing was chosen yet (the caller then steps
    synchronously); else the round ends with what was verified."""
    run = _Round(head, session, chooser, speculation, stop_at_rejection)
    segment = _Segment(speculation.choice, depth)
    pipe = session.frames()
    try:
        while not run.finished:
            if run.want_draft():
                run.start_draft(frame_tokens(speculation.budget.max_depth, segment.depth))
            if run.unsent and len(run.inflight) < segment.depth:
                await run.send(pipe)
                continue
            sent = await run.event()
            if sent is False:
                return  # nothing in flight and nothing more to guess
            # a frame of an earlier epoch came after a rejected token: its positions are rolled back
            if sent is not True and sent.epoch == run.epoch:
                async for step in _verified(run, sent, head, segment):
                    yield step
    except RETRYABLE:
        if not run.chosen:
            raise
    finally:
        if run.drafting is not None:  # the drafter's thread finishes it; nobody waits for it
            run.drafting.add_done_callback(lambda f: f.exception())
        await pipe.close()
        segment.end(run.chosen)
        session.settle(pipe, run.start + run.chosen)  # the last token chosen is pending
        accepted = run.chosen - (run.epoch + 1)
        speculation.record_frames(run.frames, run.compared, max(accepted, 0), run.chosen, run.most_in_flight)
