"""Attention inside a hybrid layer (Falcon-H1: attention and a Mamba mixer side by side in one block).

Such a block runs on groups of rows like every layer that keeps a state (engine/rows.py): a batch
[rows, length, H] of decode rows, a row alone, or one root-to-leaf path of a token tree. Its attention
must then see the pass's paged cache as that group: `group_attention` gives the context for one group.
- Rows that are sequences (or a chain of draft tokens): the packed pass's own attention over just those
  rows, their batch [rows, heads, length, d] laid out as a packed pass [1, heads, rows * length, d].
- A tree's path: its nodes' keys and values are stored where the tree keeps them (the step's start +
  node index), and each node attends to the cache before the tree and to the path's nodes up to itself:
  exactly its ancestors, as in the whole tree's attention.
Recurrent states are the outer pass's (its current group's).

A path is also how a sparse-attention layer whose indexer finds causality from positions (GLM-5-Next)
runs a tree (`path_attention`): for it the path's context hands back what a plain sequence would have
stored, the cache before the tree followed by the path's nodes (latents, rotary keys, indexer keys).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from corolla.engine.rows import Row, RowGroup, row_positions
from corolla.models.attention import Scores, causal_attention


def group_attention(paged, group: RowGroup):
    """The attention context of a hybrid layer run on `group` of the packed pass `paged` (a
    PagedAttention, engine/model_runner.py)."""
    (first, *_) = group.rows
    if len(group.rows) == 1 and first.tree is not None and not first.tree.is_chain:
        return path_attention(paged, first, (group.tokens - first.offset).tolist())
    rows = [replace(row, offset=i * group.length) for i, row in enumerate(group.rows)]
    return _BatchedRows(paged, type(paged)(paged.pool, paged.first_layer, rows, paged.number_of_states))


def _packed(x: torch.Tensor) -> torch.Tensor:
    """[rows, heads, length, d] -> [1, heads, rows * length, d], row after row."""
    return x.transpose(0, 1).flatten(1, 2)[None]


class _BatchedRows:
    def __init__(self, outer, rows_context):
        self.outer = outer
        self.rows = rows_context

    def linear_state(self, layer: int):
        return self.outer.linear_state(layer)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.rows.store(layer, _packed(k), _packed(v))
        return k, v

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scores: Scores
    ) -> torch.Tensor:
        rows, heads, length = q.shape[:3]
        out = self.rows.attend(layer, _packed(q), _packed(k), _packed(v), scores)  # [1, heads, N, dv]
        return out[0].view(heads, rows, length, -1).transpose(0, 1)


def path_attention(paged, row: Row, nodes: list[int]):
    """The attention context of one root-to-leaf path (`nodes`, indices in the row's tree) of `row`."""
    return _PathAttention(paged, row, nodes)


class _PathAttention:
    def __init__(self, outer, row: Row, nodes: list[int]):
        self.outer = outer
        self.row = row
        self.rows = [row]
        size = outer.pool.page_size
        positions = row.position + torch.tensor(nodes, dtype=torch.long, device=row.table.device)
        self.slots = row.table[positions // size] * size + positions % size  # the path's nodes' slots

    def linear_state(self, layer: int):
        return self.outer.linear_state(layer)

    def _history(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache before the tree, then the path's nodes: [position + path, ...]."""
        before = replace(self.row, length=0)
        return torch.cat([row_positions(cache, before), cache.flatten(0, 1)[self.slots]])

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pages = self.outer.pool.layer(self.outer.first_layer + layer)
        pages.keys.flatten(0, 1)[self.slots] = k[0].transpose(0, 1)  # k: [1, heads, path, d]
        pages.values.flatten(0, 1)[self.slots] = v[0].transpose(0, 1)
        return self._keys_and_values(pages) if pages.shape.gathers else (k, v)

    def _keys_and_values(self, pages) -> tuple[torch.Tensor, torch.Tensor]:
        """What the path has stored so far, as [1, heads, position + path, d] each."""
        keys = self._history(pages.keys).transpose(0, 1)[None]
        values = self._history(pages.values).transpose(0, 1)[None]
        return keys, values

    def store_indexer(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """The path's indexer keys [1, path, D]: stored; the history before the tree and the path's."""
        cache = self.outer.pool.layer(self.outer.first_layer + layer).indexer  # [pages, page_size, 1, D]
        cache.flatten(0, 1)[self.slots] = keys[0, :, None]
        return self._history(cache)[:, 0][None]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scores: Scores
    ) -> torch.Tensor:
        pages = self.outer.pool.layer(self.outer.first_layer + layer)
        # a gathering layer's k and v are the path's whole history already (store's)
        keys, values = (k, v) if pages.shape.gathers else self._keys_and_values(pages)
        return causal_attention(q, keys, values, self.row.position, scores)
