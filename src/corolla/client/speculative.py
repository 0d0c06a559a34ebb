"""Speculative decoding through the swarm: a draft verified in one step, the model's own tokens kept.

Each step sends the last chosen token (the root) and a draft (client/drafting.py: a chain or a tree)
through the chain of servers as ONE step; every server runs the whole tree in one engine pass with the
tree's attention mask, batched with other sessions' steps. Back on the client, the head gives logits at
every token of the tree, and verification walks it from the root: at each token, the next token is
chosen exactly as plain decoding chooses it (`Chooser`: penalties, greedy or sampled with the request's
own generator); if a child of that token in the tree is that same token, the walk moves to it, else the
step ends with the chosen token. So every token emitted is the one plain decoding would emit, with the
same random draws in the same order: greedy output is identical, and sampled output with a seed is the
same as without speculation (the accepted tokens follow the model's distribution, as SpecExec's
verification by sampling from the target does). The session then keeps the walked path's keys and
values on every server (`InferenceSession.accept`) and drops the rest of the tree.

A stop string, EOS or max_new_tokens ends the walk at once: no token past it is emitted, and the session
keeps only what precedes the last emitted token. `DraftBudget` sets each step's depth from the measured
acceptance and step times (no draft at all when drafting does not pay).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from corolla.client.draft_budget import DraftBudget, SpeculationStats
from corolla.client.drafting import Draft, Drafter, DraftSession, PromptLookup, check_same_tokenizer
from corolla.client.head_batcher import HeadBatcher
from corolla.client.inference_session import InferenceSession
from corolla.config import SpeculationConfig
from corolla.models.config import ModelConfig
from corolla.models.tree import TokenTree

if TYPE_CHECKING:
    from corolla.client.generation import Chooser, GenerationStep

LOOKUP_WIDTH = 2  # prompt lookup's default branching: the 2 latest places the last tokens appeared


@dataclass
class Speculation:
    """One generation's drafting: the drafter's state, the depth policy, where drafts run, the counters."""

    drafter: DraftSession
    budget: DraftBudget
    max_tokens: int  # drafted tokens per step, before the servers' own limit
    executor: Executor | None = None  # where a draft model runs, off the event loop (None: inline)
    stats: SpeculationStats | None = None


async def speculate(
    head: HeadBatcher, session: InferenceSession, chooser: Chooser, speculation: Speculation
) -> AsyncIterator[GenerationStep]:
    """Decode the rest of a generation whose last chosen token is the session's pending one."""
    while not chooser.done:
        started = time.perf_counter()
        draft = await _draft(session, chooser, speculation)
        nodes = [int(chooser.context[0, -1]), *draft.tokens]
        tree = draft.tree() if draft.tokens else None
        outputs = await session.astep(head.head.embed(torch.tensor([nodes])), tree=tree)
        logits = await head.logits(outputs[0])  # [tokens, vocab]
        steps, path, accepted = verify(chooser, logits, nodes, TokenTree(tree) if tree else None)
        if tree is not None:
            session.accept(path)
        session.pending_token_ids = steps[-1].tokens[:, None]
        speculation.budget.record(draft.depth, accepted, time.perf_counter() - started)
        if speculation.stats is not None:
            speculation.stats.add(len(draft), accepted, len(steps))
        for step in steps:
            yield step


async def _draft(session: InferenceSession, chooser: Chooser, speculation: Speculation) -> Draft:
    """A draft as deep as the budget says, within what is left of the generation and of the session."""
    room = min(session.max_length - session.position, session.max_tree_tokens) - 1
    depth = speculation.budget.depth(min(chooser.params.max_new_tokens - chooser.num_chosen - 1, room))
    if depth == 0:
        return Draft()
    args = (chooser.context[0].tolist(), depth, min(room, speculation.max_tokens))
    if speculation.executor is None:
        return speculation.drafter.propose(*args)
    return await asyncio.get_running_loop().run_in_executor(
        speculation.executor, speculation.drafter.propose, *args
    )


def verify(
    chooser: Chooser, logits: torch.Tensor, nodes: list[int], tree: TokenTree | None
) -> tuple[list[GenerationStep], list[int], int]:
    """Walk the verified tree from its root: (the steps chosen, the path of tokens whose keys and values
    the session keeps, how many drafted tokens were accepted)."""
    steps, path, node, accepted = [], [0], 0, 0
    while True:
        step = chooser.choose(logits[node : node + 1])
        steps.append(step)
        token = int(step.tokens[0])
        children = tree.children(node) if tree is not None else []
        child = next((c for c in children if nodes[c] == token), None)
        if child is not None:
            accepted += 1
        if child is None or chooser.done:
            return steps, path, accepted
        path.append(child)
        node = child


class Speculator:
    """A model's means to speculate: its drafter (loaded once), the thread drafts run in, the counters."""

    def __init__(self, config: SpeculationConfig, drafter: Drafter):
        self.config, self.drafter = config, drafter
        self.stats = SpeculationStats()
        # one budget for all generations of the model: what one measured, the next starts from
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
        from corolla.client.draft_model import DraftModel
        from corolla.models.source import resolve_model

        source = resolve_model(config.draft)
        check_same_tokenizer(source.path, target_folder, target)
        width = config.width or 1
        drafter = DraftModel.load(source.path, width, config.quantize, source.name, target.vocab_size)
        return cls(config, drafter)

    def start(self, max_length: int) -> Speculation:
        drafter = self.drafter.start(max_length)
        return Speculation(drafter, self.budget, self.config.max_tokens, self.executor, self.stats)

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False)
