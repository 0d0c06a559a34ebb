"""A draft model: a small causal LM on the client that guesses the next tokens, as a chain or a tree.

The draft model is the whole model as one corolla `Span` (transformers' own layers) plus its `ModelHead`,
so any family corolla serves can draft, at full precision or quantized (torchao int8/int4: a quantized
local copy of the target is a good drafter for a swarm of full-precision servers). Each generation keeps
its own attention cache (`DraftModelSession`): the text so far, then the last draft tree.

Drafting a tree (SpecExec's idea, with a bounded width): from the root (the last token chosen), each
level takes the `width` likeliest continuations of the previous level's tokens (by the draft's cumulative
log-probability; only those at least a tenth as likely as the level's best, so the tree branches where
the draft hesitates) and runs them in one pass over the tree's attention mask, so a tree of depth d costs
d passes of the draft model whatever its width. Width 1 drafts a chain. At the next proposal the session
keeps the tree's path that the text followed (its keys and values moved into place) and drops the rest.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from corolla.decoding.drafting import Draft
from corolla.errors import UnsupportedModel
from corolla.models.contiguous import ContiguousCache
from corolla.models.head import ModelHead
from corolla.models.span import Span
from corolla.models.tree import TokenTree

BRANCH_LOG_RATIO = math.log(0.1)  # a level keeps alternatives at least a tenth as likely as its best


class DraftModel:
    def __init__(self, span: Span, head: ModelHead, width: int, name: str, vocab_size: int | None = None):
        self.span = span
        self.head = head
        self.width = width
        self.name = name
        # drafts only tokens the target knows (a family's models may pad their embeddings differently)
        self.vocab_size = vocab_size or span.config.vocab_size

    @classmethod
    def load(
        cls,
        folder: str | Path,
        width: int = 1,
        quantize: str | None = None,
        name: str = "",
        vocab_size: int | None = None,
        device: torch.device | str = "cpu",
    ) -> DraftModel:
        from corolla.models.model_config import ModelConfig

        config = ModelConfig.from_folder(folder)
        span = Span.load(folder, 0, config.num_hidden_layers, quantize=quantize, device=device)
        if span.state_blocks:
            raise UnsupportedModel(
                f"draft model {folder}: its {config.model_type} layers keep recurrent states, which a draft "
                "model's cache cannot roll back through its trees; draft with an attention-only model or "
                "with prompt lookup"
            )
        head = ModelHead.load(folder).to(device)
        return cls(span, head, width, name or Path(folder).name, vocab_size)

    def start(self, max_length: int) -> DraftModelSession:
        return DraftModelSession(self, max_length)


class DraftModelSession:
    def __init__(self, model: DraftModel, max_length: int):
        self.model = model
        span = model.span
        # room for the text and one tree beyond it
        self.cache = ContiguousCache.for_span(span, 1, max_length + 1024)
        self.tokens: list[int] = []  # the tokens whose keys and values the cache holds, in order
        # the last draft: its start, tree and tokens, and how many of them ran (the last level never runs)
        self.tree: tuple[int, TokenTree, list[int], int] | None = None

    def propose(self, context: list[int], depth: int, max_tokens: int) -> Draft:
        if depth < 1 or max_tokens < 1 or len(context) + max_tokens >= self.cache.max_length:
            return Draft()
        with self.model.span.computing():
            root_logits = self._sync(context)
            return self._expand(root_logits, depth, max_tokens)

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Bring the cache to `context` (keeping the path of the last tree the text followed); returns the
        logits after its last token."""
        if self.tree is not None:
            start, tree, tokens, num_run = self.tree
            self.tree = None
            path = [node for node in _followed(tree, tokens, context[start:]) if node < num_run]
            self.cache.keep(start, path)
            self.tokens = self.tokens[:start] + [tokens[node] for node in path]
        common = 0
        for ours, theirs in zip(self.tokens, context[:-1], strict=False):  # the last token is fed again
            if ours != theirs:
                break
            common += 1
        self.cache.position = common
        self.tokens = context[:]
        return self._run(context[common:], None, None)[-1]

    def _expand(self, root_logits: torch.Tensor, depth: int, max_tokens: int) -> Draft:
        """Level by level, the `width` likeliest continuations of the previous level (one pass each)."""
        width = self.model.width
        start = self.cache.position
        tokens: list[int] = []
        parents: list[int] = []
        num_run = 0  # tokens whose keys and values are stored
        frontier = [(-1, root_logits, 0.0)]  # (node, its logits, its cumulative log-probability)
        for level in range(depth):
            candidates = []
            for node, logits, score in frontier:
                logprobs = torch.log_softmax(logits[: self.model.vocab_size].float(), dim=-1)
                best = torch.topk(logprobs, width)
                candidates += [
                    (score + v, node, t)
                    for v, t in zip(best.values.tolist(), best.indices.tolist(), strict=True)
                ]
            chosen = sorted(candidates, key=lambda c: -c[0])[: min(width, max_tokens - len(tokens))]
            # branch only where the draft hesitates: a confident level stays one token wide
            chosen = [c for c in chosen if c[0] >= chosen[0][0] + BRANCH_LOG_RATIO] if chosen else []
            if not chosen:
                break
            first = len(tokens)
            for _, parent, token in chosen:
                parents.append(parent)
                tokens.append(token)
            if level + 1 == depth or len(tokens) >= max_tokens:
                break  # leaves need no pass of their own
            tree = TokenTree(parents)
            logits = self._run(tokens[first:], tree, start)
            num_run = len(tokens)
            frontier = [(first + i, logits[i], chosen[i][0]) for i in range(len(chosen))]
        if tokens:
            self.tree = (start, TokenTree(parents), tokens, num_run)
            self.cache.position = start  # the tree's keys stay stored past the text until kept
        return Draft(tokens, parents)

    def _run(self, new: list[int], tree: TokenTree | None, start: int | None) -> torch.Tensor:
        """Run `new` tokens at the cache's position (a sequence, or the last tokens of `tree` stored from
        `start`); returns their logits [len(new), vocab]."""
        model = self.model
        cache = self.cache
        ids = torch.tensor([new], dtype=torch.long, device=model.span.device)
        hidden = model.head.embed(ids).to(model.span.dtype)
        positions = None
        if tree is not None:
            positions = tree.positions(start)[len(tree) - len(new) :].to(model.span.device)
        cache.tree = tree
        try:
            outputs = model.span(hidden, cache, cache.position, positions=positions)
        finally:
            cache.tree = None
        cache.position += len(new)
        return model.head.logits(outputs[0].to(model.head.dtype))


def _followed(tree: TokenTree, tokens: list[int], text: list[int]) -> list[int]:
    """The path of the tree that `text` (the tokens after the tree's start) follows from a root."""
    path: list[int] = []
    node = -1
    for token in text:
        child = next((c for c, p in enumerate(tree.parents) if p == node and tokens[c] == token), None)
        if child is None:
            break
        path.append(child)
        node = child
    return path
