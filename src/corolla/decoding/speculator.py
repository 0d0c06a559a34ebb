"""A model's means to speculate: its drafter (loaded once), where drafts run, the depth policy, counters.

`Speculator.start` gives each one-row generation its `Speculation`: the drafter's state for that text,
the budget (shared by every generation of the model: what one measured, the next starts from) and the
thread a draft model runs in. Drafting itself needs no network; client/generation/speculative.py sends the
drafts.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from corolla.config import SpeculationConfig
from corolla.decoding.draft_budget import DraftBudget, SpeculationStats
from corolla.decoding.drafting import Draft, Drafter, DraftSession, PromptLookup, check_same_tokenizer
from corolla.decoding.mtp import MTP, MtpDrafter
from corolla.decoding.round_choice import RoundChoice
from corolla.errors import InvalidRequest
from corolla.models.head import ModelHead
from corolla.models.model_config import ModelConfig

LOOKUP_WIDTH = 2  # prompt lookup's default branching: the 2 latest places the last tokens appeared


@dataclass
class Speculation:
    """One generation's drafting: the drafter's state, the depth policy, where drafts run, the counters."""

    drafter: DraftSession
    budget: DraftBudget
    max_tokens: int  # drafted tokens per step, before the servers' own limit
    choice: RoundChoice = field(default_factory=lambda: RoundChoice(1))  # pipelined rounds or not
    executor: Executor | None = None  # where a draft model runs, off the event loop (None: inline)
    stats: SpeculationStats | None = None

    async def draft(self, context: list[int], max_depth: int, room: int) -> Draft:
        """A draft after `context` (token ids) as deep as the budget says within `max_depth` tokens along
        any path and `room` tokens in all (0 or less: no draft)."""
        depth = self.budget.depth(min(max_depth, room))
        if depth == 0:
            return Draft()
        return await self._propose(context, depth, min(room, self.max_tokens))

    async def draft_chain(self, context: list[int], max_tokens: int) -> list[int]:
        """A chain of at most `max_tokens` (and `max_depth`) tokens after `context`: a frame of pipelined
        speculation (client/generation/pipelined.py); of a tree, its likeliest path."""
        depth = min(max_tokens, self.budget.max_depth)
        if depth < 1:
            return []
        return (await self._propose(context, depth, depth)).first_path()

    async def _propose(self, context: list[int], depth: int, max_tokens: int) -> Draft:
        if self.executor is None:
            return self.drafter.propose(context, depth, max_tokens)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.drafter.propose, context, depth, max_tokens)

    def observe(self, index: int, hidden: torch.Tensor, context: torch.Tensor) -> None:
        """Verified outputs of the last block [T, H] after the text's tokens at `index`, index + 1, ...
        (indices into `context` [n], the text with every token chosen so far), for drafters that draft from
        them (MTP: decoding/mtp.py); outputs before the text's first token are left out."""
        observe = getattr(self.drafter, "observe", None)
        if observe is None:
            return
        if index < 0:
            hidden = hidden[-index:]
            index = 0
        chosen = context[index + 1 : index + 1 + hidden.shape[0]].tolist()  # the token chosen from each
        if chosen:
            observe(index, hidden[: len(chosen)], chosen)

    def record_frames(self, frames: int, drafted: int, accepted: int, emitted: int, in_flight: int) -> None:
        if self.stats is not None:
            self.stats.add(drafted, accepted, emitted, steps=frames, in_flight=in_flight)

    def record(self, draft: Draft, accepted: int, emitted: int, seconds: float) -> None:
        self.budget.record(draft.depth, accepted, seconds)
        if self.stats is not None:
            self.stats.add(len(draft), accepted, emitted)


class Speculator:
    def __init__(self, config: SpeculationConfig, drafter: Drafter):
        self.config = config
        self.drafter = drafter
        self.stats = SpeculationStats()
        self.budget = DraftBudget(config.max_depth, config.adaptive)
        trees = (config.width or 1) > 1  # asked for: never pipelined (prompt lookup's default tree is)
        self.choice = RoundChoice(1 if trees else config.pipeline, config.adaptive)
        # a draft model's passes run off the event loop, one at a time (OpenMP settings are per thread)
        self.executor = (
            ThreadPoolExecutor(
                1, "corolla-draft", initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),)
            )
            if config.uses_model
            else None
        )

    @classmethod
    def create(
        cls, config: SpeculationConfig, target: ModelConfig, target_folder: Path, head: ModelHead
    ) -> Speculator:
        if not config.uses_model:
            return cls(config, PromptLookup(config.width or LOOKUP_WIDTH))
        if config.draft == MTP:  # the checkpoint's own layers, beside the client's head
            if config.quantize or (config.width or 1) > 1:
                raise InvalidRequest(
                    "--draft mtp drafts chains with the layers as stored (no width, no quantize)"
                )
            return cls(config, MtpDrafter.load(target_folder, target, head))
        from corolla.decoding.draft_model import DraftModel
        from corolla.models.devices import resolve_device
        from corolla.models.source import resolve_model

        source = resolve_model(config.draft)
        check_same_tokenizer(source.path, target_folder, target)
        width = config.width or 1
        device = resolve_device(config.device, "the draft model's device (--draft-device)")
        drafter = DraftModel.load(source.path, width, config.quantize, source.name, target.vocab_size, device)
        return cls(config, drafter)

    def start(self, max_length: int) -> Speculation:
        drafter = self.drafter.start(max_length)
        max_tokens = self.config.max_tokens
        return Speculation(drafter, self.budget, max_tokens, self.choice, self.executor, self.stats)

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False)
