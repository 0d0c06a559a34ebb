"""corolla's attention inside transformers' own decoder layers: where keys and values live, and how a
token attends to them.

transformers' attention modules compute queries, keys and values, apply their rotary embeddings, then
call `cache.update(keys, values, layer_idx)` and the attention function registered under
`config._attn_implementation`. corolla plugs in at both points: `ContextCache` (a `Cache`,
models/context_cache.py) hands the new keys and values to the pass's attention context, which stores them
(a session's contiguous buffers, or the engine's paged pool), and `attention` (registered as "corolla")
lets the context compute each sequence's attention over its own keys, with the layer's scaling, sliding
window, logit soft-capping, and DeepSeek sparse attention's selection of keys. Positions are absolute;
causal and sliding-window masks are built from them, so no padding mask is ever needed (layers whose own
code applies the mask, sparse attention's indexer, get each query's visible keys as one).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from corolla.errors import UnsupportedModel
from corolla.models.model_config import ATTENTION_NAME
from corolla.models.tree import TokenTree

# what attention modules pass an attention function besides q, k, v, mask, scaling, window, soft-cap: what
# cannot change scores, gpt-oss's sinks, sparse attention's keys; any other argument is refused
_INERT = frozenset({"dropout", "position_ids", "position_embeddings", "use_cache", "cache_position"})
KNOWN_ARGUMENTS = _INERT | {"output_attentions", "is_causal", "s_aux", "indices"}


@dataclass(frozen=True, slots=True)
class Scores:
    """How a layer turns q.k into attention weights (its own settings, passed by transformers)."""

    scaling: float | None = None
    window: int | None = None  # keys at positions > q - window are seen (transformers' convention)
    chunk: int | None = None  # keys in the query's own chunk of this many positions only (Llama 4)
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [heads] logits of a sink every query also attends to (gpt-oss)
    # [B, T, top-k] the keys each query may see besides (DeepSeek sparse attention's indexer)
    indices: torch.Tensor | None = None
    # [B, 1, T, K] bool: the layer's own mask, where its code makes one (GLM-5-Next's sparse attention turns
    # its indexer's selection into the mask it hands the attention function)
    visible: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class CacheShape:
    """What a layer hands its cache per token: keys [key_heads, key_dim] and values [value_heads,
    value_dim] (measured from the layers at load, models/span.py).

    `gathers`: the layer reads its whole history back from the cache's `update` and transforms it before
    attending. Multi-head latent attention (DeepSeek-V3, Kimi K2) caches a compressed latent (as "keys")
    and its rotary key (as "values"), one head each, and expands them into every head's keys and values
    after `update`; the attention function then gets every position's expanded keys. Other layers store
    their keys and values and let the attention function read them from the cache.
    """

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    gathers: bool = False
    index_dim: int = 0  # DeepSeek sparse attention's indexer key per token (0: no indexer)

    def bytes_per_token(self, itemsize: int) -> int:
        return (self.key_heads * self.key_dim + self.value_heads * self.value_dim + self.index_dim) * itemsize


class AttentionContext(Protocol):
    """Owns the keys and values of one pass; `layer` counts from the first block the pass runs."""

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, kv_heads, T, d] of the new tokens. Returns what the layer gets back from its cache:
        k, v themselves, or for a gathering layer (CacheShape.gathers) every position's."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scores: Scores
    ) -> torch.Tensor:
        """q: [B, heads, T, d]; k, v: the new tokens' keys and values (every position's for a gathering
        layer). Returns [B, heads, T, d of v]."""
        ...


@dataclass
class _Pass:
    context: AttentionContext
    first_layer: int  # the global layer index of the context's layer 0


_ACTIVE: ContextVar[_Pass | None] = ContextVar("corolla_attention_pass", default=None)


@contextlib.contextmanager
def active_context(context: AttentionContext, first_layer: int) -> Iterator[None]:
    token = _ACTIVE.set(_Pass(context, first_layer))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current_pass() -> _Pass:
    current = _ACTIVE.get()
    if current is None:
        raise RuntimeError("corolla attention ran outside a span's pass")
    return current


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls as "corolla": [B, T, heads, d] out, no weights.
    Dropout (in kwargs) never applies: spans run in eval mode."""
    unknown = set(kwargs) - KNOWN_ARGUMENTS
    if unknown:  # a family whose attention takes more than corolla applies (Inkling's position_bias)
        raise UnsupportedModel(
            f"{type(module).__name__} passes {sorted(unknown)} to its attention function, which corolla's "
            "does not apply"
        )
    current = current_pass()
    visible = _visible(attention_mask)
    chunk = _chunk(module)
    scores = Scores(
        scaling, sliding_window, chunk, softcap, kwargs.get("s_aux"), kwargs.get("indices"), visible
    )
    out = current.context.attend(module.layer_idx - current.first_layer, query, key, value, scores)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, attention)


def _chunk(module: torch.nn.Module) -> int | None:
    """The chunk a chunked-attention layer's queries see (Llama 4: `attention_chunk_size`, which its code
    applies through the mask it builds, not through the attention function's arguments); None otherwise."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    if not types or types[module.layer_idx] != "chunked_attention":
        return None
    return config.attention_chunk_size


def _visible(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A layer's own mask as [B, 1, T, K] bool (True: visible): boolean as it is, additive where a key's
    term is not a large negative number."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    scores: Scores,
    tree: TokenTree | None = None,
) -> torch.Tensor:
    """Attention of queries at positions [q_start, q_start + T) over keys at positions [0, len(k)).

    With `tree`, the T queries are a token tree starting at q_start (models/tree.py): each attends to the
    keys before q_start and to its own ancestors among the last T keys. With `scores.indices`, each query
    sees only its selected keys among those."""
    if tree is not None or scores.indices is not None or scores.visible is not None:
        return masked_attention(q, k, v, visible_keys(q_start, q.shape[2], k.shape[2], scores, tree), scores)
    if scores.chunk is not None:
        return _chunked(q, k, v, q_start, scores)
    if scores.softcap is not None or scores.sinks is not None:
        return _by_hand(q, k, v, _mask(q_start, q.shape[2], k.shape[2], scores.window, q.device), scores)
    num_queries = q.shape[2]
    num_keys = k.shape[2]
    window = scores.window
    sdpa = {"scale": scores.scaling, "enable_gqa": True}
    if num_queries == 1 and (window is None or num_keys <= window):
        # one new token sees every key: no mask at all, SDPA's fastest path
        return F.scaled_dot_product_attention(q, k, v, **sdpa)
    if num_queries == 1:
        return F.scaled_dot_product_attention(q, k[:, :, -window:], v[:, :, -window:], **sdpa)
    if q_start == 0 and num_keys == num_queries and (window is None or num_keys <= window):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **sdpa)
    return masked_attention(q, k, v, _mask(q_start, num_queries, num_keys, window, q.device), scores)


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scores: Scores) -> torch.Tensor:
    """Chunked attention over a sequence: queries that all lie in one chunk attend causally over that
    chunk's keys alone (positions shifted to it, SDPA's fast paths); others through the chunked mask."""
    first = q_start // scores.chunk * scores.chunk
    if (q_start + q.shape[2] - 1) // scores.chunk * scores.chunk != first:
        mask = _mask(q_start, q.shape[2], k.shape[2], scores.window, q.device, scores.chunk)
        return masked_attention(q, k, v, mask, scores)
    within = replace(scores, chunk=None)
    return causal_attention(q, k[:, :, first:], v[:, :, first:], q_start - first, within)


def visible_keys(
    q_start: int, num_queries: int, num_keys: int, scores: Scores, tree: TokenTree | None = None
) -> torch.Tensor:
    """[T, K] (or [B, 1, T, K] with indices or the layer's own mask) which keys each query sees: causal or
    the tree's, within the window, among the indexer's selection and within the layer's mask."""
    if tree is not None:
        mask = tree.mask(q_start, scores.window, scores.chunk)
    else:
        mask = _mask(q_start, num_queries, num_keys, scores.window, torch.device("cpu"), scores.chunk)
    if scores.indices is not None:
        indices = scores.indices.long().cpu()  # [B, T, top-k]
        selected = torch.zeros(*indices.shape[:2], num_keys, dtype=torch.bool).scatter_(-1, indices, True)
        mask = (mask & selected)[:, None]
    if scores.visible is not None:
        mask = mask & scores.visible.cpu()
    return mask


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scores: Scores
) -> torch.Tensor:
    """Attention where `mask` [T, K] (True: visible) says which keys each query sees."""
    mask = mask.to(q.device)  # token trees build theirs on the CPU
    if scores.softcap is not None or scores.sinks is not None:
        return _by_hand(q, k, v, mask, scores)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scores.scaling, enable_gqa=True)


def _mask(
    q_start: int,
    num_queries: int,
    num_keys: int,
    window: int | None,
    device: torch.device,
    chunk: int | None = None,
) -> torch.Tensor:
    q_pos = torch.arange(q_start, q_start + num_queries, device=device)[:, None]  # [T, 1]
    k_pos = torch.arange(num_keys, device=device)[None, :]  # [1, K]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    if chunk is not None:
        mask &= k_pos // chunk == q_pos // chunk
    return mask


def _by_hand(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scores: Scores
) -> torch.Tensor:
    """Attention with tanh soft-capping of the logits (Gemma 2) or attention sinks (gpt-oss), which SDPA
    cannot do."""
    batch, heads, length, _ = q.shape
    # each key head's queries as one [groups * T] run (no copy of the keys per query head)
    grouped = q.reshape(batch, k.shape[1], -1, q.shape[-1])
    scaling = scores.scaling if scores.scaling is not None else 1 / math.sqrt(q.shape[-1])
    logits = (torch.matmul(grouped, k.transpose(2, 3)) * scaling).view(batch, heads, length, k.shape[2])
    if scores.softcap is not None:
        logits = torch.tanh(logits / scores.softcap) * scores.softcap
    logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    if scores.sinks is not None:  # a column per head that every query sees; its weight is dropped
        sinks = scores.sinks.to(logits.dtype).reshape(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        logits = torch.cat([logits, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        weights = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(q.dtype)
    else:
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    grouped = weights.reshape(batch, v.shape[1], -1, weights.shape[-1])
    return torch.matmul(grouped, v).view(batch, heads, length, v.shape[-1])


class NoCache:
    """A pass over whole sequences that start at position 0: nothing is stored."""

    def linear_state(self, layer: int) -> None:
        return None  # a fresh state per layer (ContextCache's)

    def store_indexer(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        return keys

    def visibility(self, num_queries: int) -> torch.Tensor:
        """What each query sees, as a layer's attention_mask [1, 1, T, K] (True: visible)."""
        return _mask(0, num_queries, num_queries, None, torch.device("cpu"))[None, None]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v  # whole sequences: the new tokens are every position

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scores: Scores
    ) -> torch.Tensor:
        return causal_attention(q, k, v, 0, scores)
