"""Drafters for speculative decoding: cheap guesses of the next tokens, which the swarm then verifies.

A drafter proposes a `Draft`: tokens that may follow the current text, as a chain or a tree (each drafted
token's parent is another drafted token or the tree's root, the last token chosen). The swarm runs the
root and the draft in one step; the client keeps what the model itself would have chosen
(client/generation/speculative.py), so a draft can only change the speed, never the output. A drafter serves
many generations: `start()` gives the state of one (`DraftSession`).

- `PromptLookup`: n-grams of the prompt and the text so far (no model; helps most where answers quote
  their input), a chain or a tree of every place the last tokens appeared.
- `DraftModel` (decoding/draft_model.py): a small causal LM run on the client, a chain or a tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from corolla.errors import InvalidRequest

if TYPE_CHECKING:
    from corolla.models.model_config import ModelConfig

# prompt lookup matches the last 3 tokens, else the last 2, else the last one
NGRAM = 3
MIN_NGRAM = 1


@dataclass(frozen=True)
class Draft:
    tokens: list[int] = field(default_factory=list)
    # per drafted token: -1 (it follows the root) or the index of an earlier drafted token
    parents: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return max(depths, default=0)

    def first_path(self) -> list[int]:
        """The tokens of the path that follows each node's first child (a chain's every token)."""
        path: list[int] = []
        parent = -1
        for index, (token, node_parent) in enumerate(zip(self.tokens, self.parents, strict=True)):
            if node_parent == parent:
                path.append(token)
                parent = index
        return path

    def tree(self) -> tuple[int, ...]:
        """The parents of the verified step's tokens: the root (index 0), then the drafted tokens."""
        return (-1, *(parent + 1 for parent in self.parents))


class DraftSession(Protocol):
    def propose(self, context: list[int], depth: int, max_tokens: int) -> Draft:
        """Tokens that may follow `context` (the text so far, its last token being the root), at most
        `depth` along any path and `max_tokens` in all."""
        ...


class Drafter(Protocol):
    name: str

    def start(self, max_length: int) -> DraftSession:
        """The drafting state of one generation whose text stays within `max_length` tokens."""
        ...


class PromptLookup:
    """Prompt lookup: where the text's last tokens appeared before, draft what followed them there.

    The last NGRAM tokens are looked up in the prompt and the text so far (then fewer, down to one,
    when they never appeared); the continuations of the `width` most recent places they appeared are
    merged into a tree (shared beginnings once), so a passage quoted twice with different endings drafts
    both. transformers' `PromptLookupCandidateGenerator` does the same lookup for one chain, from the
    earliest place only (the start of the prompt), which drafts worse for answers that quote their
    input late in it and gives no branches; hence this tensor search over every match.
    """

    name = "lookup"

    def __init__(self, width: int = 2):
        self.width = width

    def start(self, max_length: int) -> PromptLookup:
        return self  # nothing per generation

    def propose(self, context: list[int], depth: int, max_tokens: int) -> Draft:
        ids = torch.tensor(context, dtype=torch.long)
        for size in range(NGRAM, MIN_NGRAM - 1, -1):
            if len(context) <= size:
                continue
            windows = ids.unfold(0, size, 1)[:-1]  # every earlier n-gram, not the text's own end
            starts = ((windows == ids[-size:]).all(dim=1).nonzero().flatten() + size).tolist()
            if starts:
                break
        else:
            return Draft()
        draft = Draft()
        nodes: dict[tuple[int, int], int] = {}  # (parent, token) -> index: the branches' shared beginnings
        for start in reversed(starts[-self.width :]):  # the most recent first
            parent = -1
            for token in context[start : start + depth]:
                if (parent, token) not in nodes:
                    if len(draft) >= max_tokens:
                        break
                    nodes[parent, token] = len(draft)
                    draft.tokens.append(token)
                    draft.parents.append(parent)
                parent = nodes[parent, token]
        return draft


def check_same_tokenizer(draft_folder: Path, target_folder: Path, target: ModelConfig) -> None:
    """A draft model must speak the target's tokens: the same tokenizer vocabulary (from tokenizer.json
    when both folders have one, else the same vocabulary size)."""
    from tokenizers import Tokenizer

    from corolla.models.model_config import ModelConfig

    files = [Path(folder) / "tokenizer.json" for folder in (draft_folder, target_folder)]
    if all(f.is_file() for f in files):
        draft_vocab, target_vocab = (Tokenizer.from_file(str(f)).get_vocab() for f in files)
        if draft_vocab != target_vocab:
            raise InvalidRequest(
                f"draft model {draft_folder}: its tokenizer differs from the model's ({len(draft_vocab)} vs "
                f"{len(target_vocab)} tokens, or other ids); a draft model must share the model's tokenizer"
            )
        return
    draft = ModelConfig.from_folder(draft_folder)
    if draft.vocab_size != target.vocab_size:
        raise InvalidRequest(
            f"draft model {draft_folder}: a vocabulary of {draft.vocab_size} tokens, the model's has "
            f"{target.vocab_size}; a draft model must share the model's tokenizer"
        )
