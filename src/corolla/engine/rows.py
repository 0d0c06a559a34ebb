"""The rows of a packed pass, and how layers that keep a recurrent state run over them.

A pass packs every row's tokens into one [1, N, H] tensor; attention layers take them all at once (each
row attends to its own cache). A linear-attention, Mamba or convolution layer carries a state from
token to token, so it runs on rows, not on packed tokens: `RowGroups` splits the pass into groups of rows
that can run as one batch [rows, length, H] (decode rows of the same adapter, which each add one token
to a state they hold), and every other row alone. A token tree is not a sequence: each of its
root-to-leaf paths runs from the row's state, and the row's state stays as it was before the tree (the
engine recomputes the path the next step keeps, engine/states.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import LinearAttentionLayer

from corolla.models.recurrent import RowStates, cache_layer, row_states
from corolla.models.tree import TokenTree


@dataclass(frozen=True, slots=True)
class Row:
    """One sequence row of the packed batch: its tokens [offset, offset + length) at [position, ...)."""

    offset: int
    length: int
    position: int
    table: torch.Tensor  # int64 page ids
    tree: TokenTree | None = None  # the row's tokens form this tree (a speculative step)
    adapter: str | None = None  # the LoRA adapter the row runs with
    states: RowStates | None = None  # the row's recurrent states per layer (spans with such layers)

    @property
    def context(self) -> int:
        return self.position + self.length


@dataclass(eq=False)
class RowGroup:
    """Rows run together through a layer that keeps a state: `tokens` are their packed token indices,
    row after row ([rows, length] once reshaped)."""

    rows: list[Row]
    tokens: torch.Tensor  # int64 [rows * length]
    length: int
    write: bool = True  # False for a tree's path: the row's state stays the tree's start's
    layers: dict[int, LinearAttentionLayer] = field(default_factory=dict)

    @property
    def adapter(self) -> str | None:
        return self.rows[0].adapter

    def linear_state(self, layer: int, number_of_states: int) -> LinearAttentionLayer:
        if layer not in self.layers:
            fresh = self.rows[0].position == 0
            states = None if fresh else [_state(row, layer) for row in self.rows]
            self.layers[layer] = cache_layer(states, number_of_states)
        return self.layers[layer]

    def write_back(self) -> None:
        if not self.write:
            return
        for layer, cache in self.layers.items():
            for row, state in zip(self.rows, row_states(cache, len(self.rows)), strict=True):
                row.states[layer] = state


def _state(row: Row, layer: int):
    state = None if row.states is None else row.states.get(layer)
    if state is None:
        raise RuntimeError(f"a row at position {row.position} has no state for layer {layer}")
    return state


class RowGroups:
    """The groups of a pass's rows for layers that keep a state, one at a time; `linear_state` answers
    for the group being run."""

    def __init__(self, rows: list[Row], number_of_states: int):
        self.rows = rows
        self.number_of_states = number_of_states
        self.current: RowGroup | None = None

    def __iter__(self) -> Iterator[RowGroup]:
        for group in self._groups():
            self.current = group
            try:
                yield group
            finally:
                self.current = None
            group.write_back()

    def linear_state(self, layer: int) -> LinearAttentionLayer:
        if self.current is None:
            raise RuntimeError("a layer that keeps a state ran outside a group of rows")
        return self.current.linear_state(layer, self.number_of_states)

    def singly(self) -> Iterator[RowGroup]:
        """Every row alone (each root-to-leaf path of a token tree), for layers that keep a cache of
        their own per sequence (models/layer_caches.py); the caller keeps what a `write` group leaves."""
        return self._groups(batched=False)

    def _groups(self, batched: bool = True) -> Iterator[RowGroup]:
        decoding: dict[str | None, list[Row]] = {}
        for row in self.rows:
            if batched and row.length == 1 and row.tree is None and row.position > 0:
                decoding.setdefault(row.adapter, []).append(row)
            elif row.tree is not None and not row.tree.is_chain:
                for path in row.tree.leaf_paths():
                    tokens = row.offset + torch.tensor(path, dtype=torch.long)
                    yield RowGroup([row], tokens, len(path), write=False)
            else:
                tokens = torch.arange(row.offset, row.offset + row.length)
                yield RowGroup([row], tokens, row.length, write=row.tree is None)
        for rows in decoding.values():
            yield RowGroup(rows, torch.tensor([row.offset for row in rows], dtype=torch.long), 1)


def row_positions(cache: torch.Tensor, row: Row) -> torch.Tensor:
    """A row's positions [0, context) of one layer's pages [num_pages, page_size, heads, d], gathered in
    one copy: [context, heads, d]."""
    return cache.index_select(0, row.table).flatten(0, 1)[: row.context]
