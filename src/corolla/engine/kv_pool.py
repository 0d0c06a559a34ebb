"""The engine's paged cache: keys, values (and sparse attention's indexer keys) of every page, for every
layer of the span that caches tokens."""

from __future__ import annotations

import torch

from corolla.models.attention import CacheShape


class KVPool:
    """Keys and values of every cache page, for every layer of the span that stores them (`layers`: their
    span-local indices; layers that keep a recurrent state instead have none): keys
    [layers, num_pages, page_size, key_heads, key_dim] and values [..., value_heads, value_dim] (of
    different shapes for multi-head latent attention, models/attention.py's CacheShape)."""

    def __init__(
        self,
        layers: int | tuple[int, ...],
        num_pages: int,
        page_size: int,
        shape: CacheShape,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        layers = tuple(range(layers)) if isinstance(layers, int) else layers
        self.index = {layer: i for i, layer in enumerate(layers)}  # span-local layer -> pool layer
        # torch.empty: the OS backs memory (and counts it) only as pages are first written
        pages = (len(layers), num_pages, page_size)
        self.keys = torch.empty(*pages, shape.key_heads, shape.key_dim, dtype=dtype, device=device)
        self.values = torch.empty(*pages, shape.value_heads, shape.value_dim, dtype=dtype, device=device)
        # DeepSeek sparse attention's indexer keys [..., 1, index_dim] (none without an indexer)
        self.indexer = torch.empty(*pages, 1, shape.index_dim, dtype=dtype, device=device)
        self.shape = shape
        self.page_size = page_size

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def _data(self) -> tuple[torch.Tensor, ...]:
        return (self.keys, self.values, self.indexer) if self.indexer.shape[-1] else (self.keys, self.values)

    def clear_pages(self, pages: list[int]) -> None:
        """Zero newly allocated pages: attention masks positions past a row's context, but a masked
        NaN left in memory would still poison the softmax."""
        if pages:
            for data in self._data:
                data[:, pages] = 0

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        for source, destination in copies:
            for data in self._data:
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
        for data in self._data:
            flat = data.flatten(1, 2)  # [layers, pages * page_size, heads, d]
            flat[:, to] = flat[:, source]
