"""A step's tokens as a tree: the draft of speculative decoding, verified by the model in one pass.

A tree of T tokens is given by its parents: `parents[i]` is -1 for a token that follows the positions
before the step (a root), else the index of an earlier token of the step. Parents come before their
children, so the order is a topological one, no cycle is possible, and a path from a root has
increasing indices. Token i sits at position `start + depth(i)` for the rotary embedding and attends to
the positions before the step and to its own ancestors (and itself), never to its siblings or cousins;
in the cache its keys and values take the step's storage slot `start + i`. A chain (`parents[i] = i - 1`)
is an ordinary multi-token step. Once the client knows which path the model accepts, the session keeps
that path's keys and values at positions start, start + 1, ... and drops the rest (`is_path` checks it).
A tree arrives from the wire: its tensors live on the CPU; a pass on a GPU moves what it uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import torch

from corolla.errors import InvalidRequest


def check_parents(parents: Sequence[int], name: str = "tree") -> None:
    """Each parent must be -1 or an earlier token of the step: anything else is a cycle or out of range."""
    for i, parent in enumerate(parents):
        if isinstance(parent, bool) or not isinstance(parent, int):
            raise InvalidRequest(f"{name}[{i}] must be an integer parent index, got {parent!r}")
        if parent == i:
            raise InvalidRequest(f"{name}[{i}]={parent}: a token cannot be its own parent (a cycle)")
        if parent > i:
            raise InvalidRequest(
                f"{name}[{i}]={parent}: a parent must come before its child (-1 or 0..{i - 1}); "
                "a later parent makes a cycle or an order the model cannot run"
            )
        if parent < -1:
            raise InvalidRequest(f"{name}[{i}]={parent} is out of range: -1 (a root) or 0..{i - 1}")


class TokenTree:
    def __init__(self, parents: Sequence[int]):
        check_parents(parents)
        self.parents = tuple(parents)

    @classmethod
    def chain(cls, length: int) -> TokenTree:
        return cls(range(-1, length - 1))

    def __len__(self) -> int:
        return len(self.parents)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenTree) and other.parents == self.parents

    def __hash__(self) -> int:
        return hash(self.parents)

    def __repr__(self) -> str:
        return f"TokenTree({list(self.parents)})"

    @cached_property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    @cached_property
    def depths(self) -> torch.Tensor:
        """[T] int64: 0 for roots, parent's depth + 1 otherwise."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(0 if parent < 0 else depths[parent] + 1)
        return torch.tensor(depths, dtype=torch.long, device="cpu")

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """[T, T] bool: row i marks token i and every ancestor of i."""
        size = len(self.parents)
        mask = torch.eye(size, dtype=torch.bool, device="cpu")
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i] |= mask[parent]
        return mask

    def children(self, node: int) -> list[int]:
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def leaf_paths(self) -> list[list[int]]:
        """Every path from a root to a leaf (a node without children), root first."""
        parents = set(self.parents)
        leaves = [node for node in range(len(self.parents)) if node not in parents]
        return [self.ancestors[leaf].nonzero().flatten().tolist() for leaf in leaves]

    def is_path(self, nodes: Sequence[int]) -> bool:
        """Whether `nodes` is a path from a root down the tree (empty: yes)."""
        previous = -1
        for node in nodes:
            if not 0 <= node < len(self.parents) or self.parents[node] != previous:
                return False
            previous = node
        return True

    def positions(self, start: int) -> torch.Tensor:
        """[T] the tokens' positions (what the rotary embedding sees) when the step starts at `start`."""
        return start + self.depths

    def mask(self, start: int, window: int | None = None, chunk: int | None = None) -> torch.Tensor:
        """[T, start + T] bool: which keys (the `start` positions before the step, then the step's tokens
        in storage order) each token attends to; with `window`, only keys at positions > its own - window;
        with `chunk`, only keys in its own chunk of positions (Llama 4's chunked attention)."""
        size = len(self.parents)
        visible = torch.cat([torch.ones(size, start, dtype=torch.bool, device="cpu"), self.ancestors], dim=1)
        q_pos = self.positions(start)
        k_pos = torch.cat([torch.arange(start, device="cpu"), q_pos])
        if window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        if chunk is not None:
            visible &= k_pos[None, :] // chunk == q_pos[:, None] // chunk
        return visible
