"""Attention over a sequence's own keys and values, with or without a cache.

A block computes queries, keys and values for its new tokens and hands them to an attention context,
which owns where past keys live: `NoCache` (a forward pass over whole sequences) or `ContiguousCache`
(one inference session's [B, kv_heads, max_length, head_dim] buffers per block). Positions are absolute;
causal and sliding-window masks are built from them.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionContext(Protocol):
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        """q: [B, heads, T, d]; k, v: [B, kv_heads, T, d] of the new tokens. Returns [B, heads, T, d]."""
        ...


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, window: int | None
) -> torch.Tensor:
    """Attention of queries at positions [q_start, q_start + T) over keys at positions [0, len(k))."""
    num_queries, num_keys = q.shape[2], k.shape[2]
    if num_queries == 1 and (window is None or num_keys <= window):
        # one new token sees every key: no mask at all, SDPA's fastest path
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if num_queries == 1:
        return F.scaled_dot_product_attention(q, k[:, :, -window:], v[:, :, -window:], enable_gqa=True)
    if q_start == 0 and num_keys == num_queries and (window is None or num_keys <= window):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    q_pos = torch.arange(q_start, q_start + num_queries)[:, None]  # [T, 1]
    k_pos = torch.arange(num_keys)[None, :]  # [1, K]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class NoCache:
    """A forward pass over whole sequences that start at position 0: nothing is stored."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        return causal_attention(q, k, v, 0, window)


class ContiguousCache:
    """Keys and values of one session for a run of blocks, in preallocated buffers.

    `position` is the number of tokens already stored; a step writes its tokens at [position, position + T)
    and the caller advances `position` once every block has run.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_length: int,
        head_dim: int,
        dtype: torch.dtype,
    ):
        # [layers, keys|values, B, kv_heads, max_length, d]; torch.empty leaves pages untouched until used
        self.buffer = torch.empty(num_layers, 2, batch_size, num_kv_heads, max_length, head_dim, dtype=dtype)
        self.max_length = max_length
        self.position = 0

    @property
    def batch_size(self) -> int:
        return self.buffer.shape[2]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        start, end = self.position, self.position + q.shape[2]
        keys, values = self.buffer[layer, 0], self.buffer[layer, 1]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return causal_attention(q, keys[:, :, :end], values[:, :, :end], start, window)

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        """Beam search: row i of the batch continues from row hypo_ids[i]."""
        stored = self.buffer[:, :, :, :, : self.position]
        stored.copy_(stored[:, :, hypo_ids])
