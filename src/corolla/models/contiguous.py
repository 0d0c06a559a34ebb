"""One session's cache in preallocated buffers: the draft model's, and the reference the engine's paged
cache is tested against."""

from __future__ import annotations

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
        num_layers: int,
        batch_size: int,
        max_length: int,
        shape: CacheShape,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        # [layers, B, heads, max_length, d]; torch.empty leaves pages untouched until used
        self.keys = torch.empty(
            num_layers, batch_size, shape.key_heads, max_length, shape.key_dim, dtype=dtype, device=device
        )
        self.values = torch.empty(
            num_layers, batch_size, shape.value_heads, max_length, shape.value_dim, dtype=dtype, device=device
        )
        # DeepSeek sparse attention's indexer keys [layers, B, max_length, index_dim]
        self.indexer = torch.empty(
            num_layers, batch_size, max_length, shape.index_dim, dtype=dtype, device=device
        )
        self.gathers = shape.gathers
        self.max_length = max_length
        self.position = 0
        self.tree: TokenTree | None = None  # the tree the next pass's tokens end (None: a sequence)
        # recurrent states (models/recurrent.py) of a sequence that only moves forward
        self.states = FreshStates()

    def linear_state(self, layer: int) -> LinearAttentionLayer:
        """A layer's recurrent state, updated in place by every pass: it follows the sequence forward only
        (`keep` and `reorder` refuse a cache holding such states)."""
        return self.states.linear_state(layer)

    def _check_no_states(self, what: str) -> None:
        if self.states.layers:
            raise UnsupportedModel(
                f"{what} needs earlier recurrent states, which a ContiguousCache does not keep"
            )

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.position
        end = self.position + k.shape[2]
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        if self.gathers:
            return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]
        return k, v

    def store_indexer(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        end = self.position + keys.shape[1]
        self.indexer[layer, :, self.position : end] = keys
        return self.indexer[layer, :, :end]

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
        if not self.gathers:  # k and v are the new tokens': the rest is in the buffers
            k = self.keys[layer, :, :, :end]
            v = self.values[layer, :, :, :end]
        if self.tree is not None:  # the tree ends with the pass's tokens; earlier ones are stored already
            size = len(self.tree)
            mask = self.tree.mask(end - size, scores.window)[size - q.shape[2] :]
            return masked_attention(q, k, v, mask, scores)
        return causal_attention(q, k, v, self.position, scores)

    def keep(self, start: int, nodes: list[int]) -> None:
        """After a tree step stored at [start, start + T): keep the keys and values of `nodes` (a path, in
        order) at start, start + 1, ...; the cache then holds start + len(nodes) positions."""
        self._check_no_states("keeping a tree's path")
        source = start + torch.tensor(nodes, dtype=torch.long, device=self.keys.device)
        for buffer in (self.keys, self.values):
            buffer[..., start : start + len(nodes), :] = buffer[..., source, :]
        self.position = start + len(nodes)

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        """Beam search: row i of the batch continues from row hypo_ids[i]."""
        for layer in self.states.layers.values():
            layer.reorder_cache(hypo_ids)
        rows = hypo_ids.to(self.keys.device)
        for buffer in (self.keys, self.values):
            stored = buffer[..., : self.position, :]
            stored.copy_(stored[:, rows])
