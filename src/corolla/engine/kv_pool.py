"""The engine's paged cache: keys, values (and sparse attention's indexer keys) of every page, for every
layer of the span that caches tokens."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from corolla.models.attention import CacheShape


@dataclass(frozen=True, slots=True)
class LayerPages:
    """One layer's part of the pool: keys [num_pages, page_size, key_heads, key_dim], values [...,
    value_heads, value_dim] and indexer keys [..., 1, index_dim] (views, written in place)."""

    keys: torch.Tensor
    values: torch.Tensor
    indexer: torch.Tensor
    shape: CacheShape


class KVPool:
    """Keys and values of every cache page for the layers of the span that store them (`shapes`: their
    span-local indices -> what they store per token; layers that keep a recurrent state instead have
    none). Layers of one shape share a tensor [layers, num_pages, page_size, heads, d] per kind (Gemma 4's
    sliding and global layers differ; multi-head latent attention's keys and values differ,
    models/attention.py's CacheShape). An aliased layer (one that attends with an earlier layer's keys and
    values, models/kv_sharing.py) reads its source's pages."""

    def __init__(
        self,
        shapes: Mapping[int, CacheShape],
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        aliases: Mapping[int, int] | None = None,
    ):
        by_shape: dict[CacheShape, list[int]] = {}
        for layer, shape in sorted(shapes.items()):
            by_shape.setdefault(shape, []).append(layer)
        self._tensors: list[torch.Tensor] = []
        self._layers: dict[int, LayerPages] = {}
        for shape, layers in by_shape.items():
            # torch.empty: the OS backs memory (and counts it) only as pages are first written
            pages = (len(layers), num_pages, page_size)
            keys = torch.empty(*pages, shape.key_heads, shape.key_dim, dtype=dtype, device=device)
            values = torch.empty(*pages, shape.value_heads, shape.value_dim, dtype=dtype, device=device)
            indexer = torch.empty(*pages, 1, shape.index_dim, dtype=dtype, device=device)
            self._tensors += [keys, values, indexer] if shape.index_dim else [keys, values]
            for slot, layer in enumerate(layers):
                self._layers[layer] = LayerPages(keys[slot], values[slot], indexer[slot], shape)
        for alias, source in (aliases or {}).items():
            if source in self._layers:
                self._layers[alias] = self._layers[source]
        self.layers = tuple(sorted(shapes))  # the layers with pages of their own
        self.page_size = page_size
        self.device = torch.device(device)

    def layer(self, layer: int) -> LayerPages:
        """The pages of span-local `layer` (its source's for an aliased layer)."""
        return self._layers[layer]

    def clear_pages(self, pages: list[int]) -> None:
        """Zero newly allocated pages: attention masks positions past a row's context, but a masked
        NaN left in memory would still poison the softmax."""
        if pages:
            for data in self._tensors:
                data[:, pages] = 0

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        for source, destination in copies:
            for data in self._tensors:
                data[:, destination] = data[:, source]

    def move_positions(self, table: list[int], sources: list[int], destinations: list[int]) -> None:
        """Copy one row's keys and values from positions `sources` to `destinations` (every layer)."""
        size = self.page_size
        pages = torch.tensor(table, dtype=torch.long, device=self.device)

        def slots(positions: list[int]) -> torch.Tensor:
            positions = torch.tensor(positions, dtype=torch.long, device=self.device)
            return pages[positions // size] * size + positions % size

        to = slots(destinations)
        source = slots(sources)
        for data in self._tensors:
            flat = data.flatten(1, 2)  # [layers, pages * page_size, heads, d]
            flat[:, to] = flat[:, source]
