"""Verifying a drafted token tree: the walk that keeps exactly the tokens plain decoding would choose.

The logits at every token of a tree (its root: the last chosen token) come back from one step through
the swarm. From the root, the next token is chosen exactly as plain decoding chooses it (`Chooser`); if
a child of the current token in the tree is that same token, the walk moves to it, else it ends with the
chosen token. So every token emitted is plain decoding's, with the same random draws in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from corolla.decoding.chooser import Chooser, GenerationStep
from corolla.models.tree import TokenTree


@dataclass(frozen=True)
class Verified:
    steps: list[GenerationStep]  # one per token emitted, in order
    path: list[int]  # the tree's tokens (indices, root first) whose keys and values the session keeps
    accepted: int  # drafted tokens accepted


def verify(chooser: Chooser, logits: torch.Tensor, nodes: list[int], tree: TokenTree | None) -> Verified:
    """Walk the tree of `nodes` (token ids, root first) with the logits [len(nodes), vocab] at each node;
    `tree` None: the root alone (no draft). A stop string, EOS or max_new_tokens ends the walk at once."""
    steps = []
    path = [0]
    node = 0
    accepted = 0
    while True:
        step = chooser.choose(logits[node : node + 1])
        steps.append(step)
        token = int(step.tokens[0])
        children = tree.children(node) if tree is not None else []
        child = next((c for c in children if nodes[c] == token), None)
        if child is not None:
            accepted += 1
        if child is None or chooser.done:
            return Verified(steps, path, accepted)
        path.append(child)
        node = child
