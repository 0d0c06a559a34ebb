"""A model's means to speculate: its drafter (loaded once), where drafts run, the depth policy, counters.

`Speculator.start` gives each one-row generation its `Speculation`: the drafter's state for that text,
the budget (shared by every generation of the model: what one measured, the next starts from) and the
thread a draft model runs in. Drafting itself needs no network; client/generation/speculative.py sends the
drafts.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from corolla.config import SpeculationConfig
from corolla.decoding.draft_budget import DraftBudget, SpeculationStats
from corolla.decoding.drafting import Draft, Drafter, DraftSession, PromptLookup, check_same_tokenizer
from corolla.models.model_config import ModelConfig

LOOKUP_WIDTH = 2  # prompt lookup's default branching: the 2 latest places the last tokens appeared


@dataclass
class Speculation:
    """One generation's drafting: the drafter's state, the depth policy, where drafts run, the counters."""

    drafter: DraftSession
    budget: DraftBudget
    max_tokens: int  # drafted tokens per step, before the servers' own limit
    executor: Executor | None = None  # where a draft model runs, off the event loop (None: inline)
    stats: SpeculationStats | None = None

    async def draft(self, context: list[int], max_depth: int, room: int) -> Draft:
        """A draft after `context` (token ids) as deep as the budget says within `max_depth` tokens along
        any path and `room` tokens in all (0 or less: no draft)."""
        depth = self.budget.depth(min(max_depth, room))
        if depth == 0:
            return Draft()
        args = (context, depth, min(room, self.max_tokens))
        if self.executor is None:
            return self.drafter.propose(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.drafter.propose, *args)

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
        # a draft model's passes run off the event loop, one at a time (OpenMP settings are per thread)
        self.executor = (
            ThreadPoolExecutor(
                1, "corolla-draft", initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),)
            )
            if config.uses_model
            else None
        )

    @classmethod
    def create(cls, config: SpeculationConfig, target: ModelConfig, target_folder: Path) -> Speculator:
        if not config.uses_model:
            return cls(config, PromptLookup(config.width or LOOKUP_WIDTH))
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
        return Speculation(drafter, self.budget, self.config.max_tokens, self.executor, self.stats)

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False)
