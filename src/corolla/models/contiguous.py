"""One session's cache in preallocated buffers: the draft model's, and the reference the engine's paged
cache is tested against."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers.cache_utils import LinearAttentionLayer

from corolla.errors import UnsupportedModel
from corolla.models.attention import CacheShape, Scores, causal_attention, masked_attention, visible_keys
from corolla.models.recurrent import FreshStates
from corolla.models.tree import TokenTree


class ContiguousCache:
    """Keys and values of one session for a run of blocks, in preallocated buffers.

    `position` is the number of tokens already stored; a step writes its tokens at [position, position + T)
    and the caller advances `position` once every block has run. With `tree` set, the positions up to the
    step's end hold a token tree (models/tree.py) whose last tokens are the step's (a tree can grow over
    several steps, a draft model's level by level); `keep` then keeps one path of it.
    """

    def __init__(
        self,
        shapes: Mapping[int, CacheShape],
        batch_size: int,
        max_length: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        aliases: Mapping[int, int] | None = None,
        number_of_states: int = 1,
    ):
        """shapes: what each caching layer (counted from the pass's first block) stores per token; an
        aliased layer (models/kv_sharing.py) attends with its source's buffers; number_of_states: the
        convolution and recurrent states a layer may keep (Inkling's: 4)."""
        # per layer [B, heads, max_length, d]; torch.empty leaves pages untouched until used
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.indexer: dict[int, torch.Tensor] = {}  # DeepSeek sparse attention's [B, max_length, index_dim]
        self.gathers: dict[int, bool] = {}
        for layer, shape in shapes.items():
            where = dict(dtype=dtype, device=device)
            keys = (batch_size, shape.key_heads, max_length, shape.key_dim)
            values = (batch_size, shape.value_heads, max_length, shape.value_dim)
            self.keys[layer] = torch.empty(*keys, **where)
            self.values[layer] = torch.empty(*values, **where)
            self.indexer[layer] = torch.empty(batch_size, max_length, shape.index_dim, **where)
            self.gathers[layer] = shape.gathers
        self.aliases = dict(aliases or {})
        self.batch_size = batch_size
        self.max_length = max_length
        self.position = 0
        self.tree: TokenTree | None = None  # the tree the next pass's tokens end (None: a sequence)
        # recurrent states (models/recurrent.py) of a sequence that only moves forward
        self.states = FreshStates(number_of_states)
        self.held_layers: dict = {}  # DeepSeek-V4's cache layer objects by layer (models/layer_caches.py)

    @classmethod
    def for_span(cls, span, batch_size: int, max_length: int) -> ContiguousCache:
        """A cache for passes over the whole of a loaded span (models/span.py), in its dtype and device."""
        shapes = {block: span.cache_shapes[block] for block in span.kv_blocks}
        return cls(
            shapes, batch_size, max_length, span.dtype, span.device, span.kv_sources, span.number_of_states
        )

    def linear_state(self, layer: int) -> LinearAttentionLayer:
        """A layer's recurrent state, updated in place by every pass: it follows the sequence forward only
        (`keep` and `reorder` refuse a cache holding such states)."""
        return self.states.linear_state(layer)

    def _check_no_states(self, what: str) -> None:
        if self.states.layers or self.held_layers:
            raise UnsupportedModel(
                f"{what} needs earlier recurrent states, which a ContiguousCache does not keep"
            )

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.position
        end = self.position + k.shape[2]
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        if self.gathers[layer]:
            return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
        return k, v

    def store_indexer(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        end = self.position + keys.shape[1]
        self.indexer[layer][:, self.position : end] = keys
        return self.indexer[layer][:, :end]

    def visibility(self, num_queries: int) -> torch.Tensor:
        """What each query of the pass sees, as a layer's attention_mask [1, 1, T, position + T]."""
        end = self.position + num_queries
        if self.tree is not None:
            size = len(self.tree)
            return self.tree.mask(end - size)[size - num_queries :][None, None]
        return visible_keys(self.position, num_queries, end, Scores())[None, None]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scores: Scores
    ) -> torch.Tensor:
        end = self.position + q.shape[2]
        layer = self.aliases.get(layer, layer)
        if not self.gathers[layer]:  # k and v are the new tokens': the rest is in the buffers
            k = self.keys[layer][:, :, :end]
            v = self.values[layer][:, :, :end]
        if self.tree is not None:  # the tree ends with the pass's tokens; earlier ones are stored already
            size = len(self.tree)
            mask = self.tree.mask(end - size, scores.window, scores.chunk)[size - q.shape[2] :]
            return masked_attention(q, k, v, mask, scores)
        return causal_attention(q, k, v, self.position, scores)

    def keep(self, start: int, nodes: list[int]) -> None:
        """After a tree step stored at [start, start + T): keep the keys and values of `nodes` (a path, in
        order) at start, start + 1, ...; the cache then holds start + len(nodes) positions."""
        self._check_no_states("keeping a tree's path")
        for buffer in self._buffers():
            source = start + torch.tensor(nodes, dtype=torch.long, device=buffer.device)
            buffer[..., start : start + len(nodes), :] = buffer[..., source, :]
        self.position = start + len(nodes)

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        """Beam search: row i of the batch continues from row hypo_ids[i]."""
        for layer in [*self.states.layers.values(), *self.held_layers.values()]:
            layer.reorder_cache(hypo_ids)
        for buffer in self._buffers():
            stored = buffer[..., : self.position, :]
            stored.copy_(stored[hypo_ids.to(buffer.device)])

    def _buffers(self) -> list[torch.Tensor]:
        """Every layer's keys and values [B, heads, max_length, d] and indexer keys [B, max_length, d]."""
        return [*self.keys.values(), *self.values.values(), *self.indexer.values()]
