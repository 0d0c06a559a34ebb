"""What each block of a span caches, measured by running it: keys and values (their shape per token),
a recurrent state (its bytes, and whether its multi-token form continues from a state), or nothing (an
MLP alone, or attention with an earlier layer's keys and values: models/kv_sharing.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from corolla.errors import UnsupportedModel
from corolla.models.attention import CacheShape
from corolla.models.compressed_sizes import held_bytes
from corolla.models.contiguous import ContiguousCache
from corolla.models.recurrent import STATELESS_LAYER_TYPES, FreshStates, row_states

Span = nn.Module  # models/span.py's Span (which imports this module)


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """What a span's blocks cache (span-local block indices)."""

    kv_blocks: tuple[int, ...]  # cache layers that store keys and values per token (a block's, mostly)
    cache_shapes: tuple[CacheShape, ...]  # what each of kv_blocks stores (Gemma 4's differ by layer type)
    state_blocks: tuple[int, ...]  # keep a recurrent state instead
    stepwise_blocks: tuple[int, ...]  # state blocks that continue from a state one token at a time
    state_bytes_per_row: int  # one sequence's states over the span


class _ShapeProbe:
    """An attention context that records what one layer of its pass (`layer`, counted from the pass's first
    block: earlier ones only feed it) stores per token, what it attends with, and whether it keeps a
    recurrent state; it attends to nothing."""

    def __init__(self, layer: int = 0, sublayers: int = 1, number_of_states: int = 1):
        self.layer = layer
        self.sublayers = sublayers  # the block's cache layers: layer, layer + 1, ... (LongCat-Flash: 2)
        self.stored: dict[int, tuple[torch.Size, torch.Size]] = {}  # by sublayer
        self.attended: dict[int, tuple[torch.Size, torch.Size]] = {}
        self.index_dim = 0
        self.states = FreshStates(number_of_states)

    def _sublayer(self, layer: int) -> int | None:
        return layer - self.layer if 0 <= layer - self.layer < self.sublayers else None

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sublayer = self._sublayer(layer)
        if sublayer is not None:
            self.stored.setdefault(sublayer, (k.shape[1:], v.shape[1:]))
        return k, v

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scores) -> torch.Tensor:
        sublayer = self._sublayer(layer)
        if sublayer is not None:
            self.attended.setdefault(sublayer, (k.shape[1:], v.shape[1:]))
        return q.new_zeros(*q.shape[:3], v.shape[-1])

    def linear_state(self, layer: int):
        return self.states.linear_state(layer)

    def store_indexer(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        if layer == self.layer:
            self.index_dim = keys.shape[-1]
        return keys

    def visibility(self, num_queries: int) -> torch.Tensor:
        return torch.ones(1, 1, num_queries, num_queries, dtype=torch.bool).tril()

    @property
    def keeps_state(self) -> bool:
        return self.layer in self.states.layers

    @property
    def state_bytes(self) -> int:
        return row_states(self.states.layers[self.layer], 1)[0].nbytes if self.keeps_state else 0


def measure_layers(span: Span) -> LayerLayout:
    """Run one token through each block alone: which blocks store keys and values (and their shape per
    token: [heads, 1, d]), which keep a recurrent state instead (its bytes, and whether it continues
    several tokens at once), and whether attention layers attend with what they stored or with something
    made from it (multi-head latent attention expands a cached latent: then the cache hands them their
    history, CacheShape.gathers). Blocks that reuse an earlier layer's keys and values (span.kv_sources)
    are not run: they store nothing."""
    kv_blocks = []
    shapes = []
    state_blocks = []
    stepwise = []  # state blocks that continue one token at a time
    state_bytes = 0
    for local in range(span.end - span.start):
        if local in span.kv_sources:
            continue
        index = span.start + local
        if span.held is not None:  # a cache of its own per sequence (models/layer_caches.py)
            state_blocks.append(local)
            state_bytes += held_bytes(span.config.hf, index, span.dtype.itemsize)[0]
            continue
        probe = _probe_block(span, index)
        block_shapes = {}
        for sublayer, stored in sorted(probe.stored.items()):  # a hybrid layer (Falcon-H1) also keeps a state
            gathers = probe.attended[sublayer] != stored
            block_shapes[sublayer] = _cache_shape(span.config.model_type, stored, gathers, probe.index_dim)
            kv_blocks.append(local * span.per_block + sublayer)
            shapes.append(block_shapes[sublayer])
        if probe.keeps_state:
            state_blocks.append(local)
            state_bytes += probe.state_bytes
            if not _continues_from_state(span, index, block_shapes.get(0)):
                if block_shapes:
                    raise UnsupportedModel(
                        f"{span.config.model_type}: block {index} attends beside a state whose multi-token "
                        "form ignores the state it is given, which corolla cannot run token by token"
                    )
                stepwise.append(local)
    return LayerLayout(tuple(kv_blocks), tuple(shapes), tuple(state_blocks), tuple(stepwise), state_bytes)


def _probe_block(span: Span, index: int) -> _ShapeProbe:
    """One token through block `index`, recorded; a block that caches nothing it should is refused."""
    model_type = span.config.model_type
    # a layer that reuses an earlier layer's sparse-attention selection runs after that layer
    first = span.start + span.selection_sources.get(index - span.start, index - span.start)
    probe = _ShapeProbe((index - first) * span.per_block, span.per_block, span.number_of_states)
    with span.computing():
        x = torch.zeros(1, 1, span.config.wire.width, dtype=span.dtype, device=span.device)
        try:
            span(x, probe, blocks=(first, index + 1))
        except UnsupportedModel as e:  # what the layer's own code asked of corolla's cache or attention
            raise UnsupportedModel(f"{model_type}: block {index}: {e}") from None
    if set(probe.stored) - set(probe.attended):
        raise UnsupportedModel(f"{model_type}: its attention does not go through transformers' cache")
    kind = span.layer_types[index]
    if not probe.stored and not probe.keeps_state and kind not in STATELESS_LAYER_TYPES:
        raise UnsupportedModel(
            f"{model_type}: block {index} ({kind}) neither caches keys and values nor keeps a state "
            "through transformers' cache interface"
        )
    return probe


def _cache_shape(
    model_type: str, stored: tuple[torch.Size, torch.Size], gathers: bool, index_dim: int
) -> CacheShape:
    keys, values = stored
    if keys[1] != 1 or values[1] != 1:
        raise UnsupportedModel(
            f"{model_type}: its attention stores keys {list(keys)} and values {list(values)} per token; "
            "corolla's cache holds [heads, 1, d] per token"
        )
    return CacheShape(keys[0], keys[2], values[0], values[2], gathers, index_dim)


def _continues_from_state(span: Span, index: int, shape: CacheShape | None) -> bool:
    """Whether block `index` (which keeps a state, and caches keys and values of `shape` if a hybrid)
    computes 2 tokens after a first one as it computes them in one pass over all 3: some of transformers'
    multi-token forms ignore the state they are given."""
    x = span.config.wire.sample(1, 3, generator=torch.Generator().manual_seed(0))
    x = x.to(span.device, span.dtype)
    shapes = {0: shape} if shape else {}
    cache = ContiguousCache(shapes, 1, 3, span.dtype, span.device, number_of_states=span.number_of_states)
    with span.computing():
        whole = span(x, blocks=(index, index + 1))
        span(x[:, :1], cache, blocks=(index, index + 1))
        cache.position = 1
        later = span(x[:, 1:], cache, position=1, blocks=(index, index + 1))
    scale = float(whole.abs().max())
    return torch.allclose(later.float(), whole[:, 1:].float(), rtol=0, atol=0.02 * scale + 1e-6)
