"""Layers whose cache is transformers' own cache layer object, one per sequence: DeepSeek-V4's attention.

Its layers keep what no page of keys holds: a sliding window of keys (which are also its values), and
in its compressed layers one compressed entry every m tokens (CSA: m = 4, with a lightning indexer's own
compressed keys; HCA: m = 128), with the compressor's buffer of tokens since the last full window and the
overlap its windows share. Its code reads and writes them through its own cache layer classes
(`cache.layers[i].store_compression_weights`, ...), concatenates the compressed entries onto its keys and
masks them itself. So what touches a sequence's cache runs one sequence at a time with that sequence's
own layer object (the cache update, the compressors, attention under the mask the layer builds), and the
rest of the block (projections, hyper-connections, experts) on every sequence of the pass at once
(`PackedRows`); a token tree's paths run the block one at a time.

A sequence's layer object is kept between passes as a value (`HeldLayer`: its fields, dicts copied) in
the row's states (engine/states.py: a snapshot is a reference, a rollback recomputes from the kept inputs),
never changed in place: the layers' code replaces its tensors (torch.cat) rather than writing into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from corolla.models.attention import Scores, active_context, masked_attention
from corolla.models.compressed_sizes import held_family
from corolla.models.lora import use_adapters
from corolla.models.row_passes import one_row, run_block


@dataclass(frozen=True, slots=True)
class HeldLayer:
    """One sequence's cache layer between passes: its class and fields (tensors shared, never written)."""

    kind: type
    fields: dict

    @property
    def nbytes(self) -> int:
        tensors = {}
        for value in self.fields.values():
            for item in value.values() if isinstance(value, dict) else (value,):
                if isinstance(item, torch.Tensor):
                    tensors[id(item)] = item.numel() * item.element_size()
        return sum(tensors.values())


def hold(layer) -> HeldLayer:
    return HeldLayer(type(layer), _copied(vars(layer)))


def restore(held: HeldLayer):
    layer = held.kind.__new__(held.kind)
    layer.__dict__.update(_copied(held.fields))
    return layer


def _copied(fields: dict) -> dict:
    return {name: dict(value) if isinstance(value, dict) else value for name, value in fields.items()}


class LayerMakers:
    """A fresh cache layer for each of a model's layers, as transformers' DynamicCache makes them."""

    def __init__(self, hf: Any):
        types, kwargs = get_layer_types_and_kwargs(hf)
        self._makers = [
            (DYNAMIC_LAYER_TYPE_MAPPING[k], given) for k, given in zip(types, kwargs, strict=True)
        ]

    def fresh(self, layer: int):
        kind, kwargs = self._makers[layer]
        return kind(**kwargs)


class RowCache(Cache):
    """transformers' cache interface over one sequence's (or one batch of sequences at one position)
    cache layers, by the layers' own index: the family's code reads `cache.layers[i]`."""

    def __init__(self, layers: dict[int, Any]):
        super().__init__(layers=[])
        self.layers = layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return getattr(self.layers.get(layer_idx), "cumulative_length", 0)


class PackedRows(Cache):
    """transformers' cache interface over sequence rows packed in one [1, N] pass, each (position, length,
    cache layer, LoRA adapter): `update` stores each row's new keys in its layer and returns every row's
    kept window and new keys one row after another, which the pass's mask (`mask`) keeps each row's queries
    to; a compressor given this cache runs row by row (`RowwiseCompressor`), its entries laid out the same
    way.
    The rest of the block (projections, hyper-connections, experts) runs on all rows at once."""

    def __init__(self, rows: list[tuple[int, int, Any, str | None]]):
        super().__init__(layers=[])
        self.rows = rows
        self.windows: list[int] = []  # per row, its keys `update` returned (kept and new)
        self.entries: list[int] = [0] * len(rows)  # per row, its compressed entries (RowwiseCompressor's)

    @property
    def layers(self) -> list:
        return [layer for _, _, layer, _ in self.rows]

    @layers.setter
    def layers(self, value) -> None:  # Cache.__init__ sets it
        pass

    def spans(self) -> list[slice]:
        starts = [0]
        for _, length, _, _ in self.rows:
            starts.append(starts[-1] + length)
        return [slice(a, b) for a, b in zip(starts, starts[1:], strict=False)]

    def adapters(self) -> list[tuple[int, int, str]]:
        """The rows' LoRA adapters as ranges of the pass's tokens (models/lora.py)."""
        spans = self.spans()
        return [
            (t.start, t.stop, adapter) for (*_, adapter), t in zip(self.rows, spans, strict=True) if adapter
        ]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        stored = [
            layer.update(key_states[:, :, tokens], value_states[:, :, tokens])
            for (_, _, layer, _), tokens in zip(self.rows, self.spans(), strict=True)
        ]
        self.windows = [k.shape[2] for k, _ in stored]
        return torch.cat([k for k, _ in stored], dim=2), torch.cat([v for _, v in stored], dim=2)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scores: Scores):
        """Each row's queries over its own keys alone (its window's, then its compressed entries'), under
        the layer's mask: the pass's other keys are masked for it anyway."""
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        window = 0
        entry = sum(self.windows)  # the compressed entries follow every row's window
        for tokens, keys, entries in zip(self.spans(), self.windows, self.entries, strict=True):
            columns = torch.cat([torch.arange(window, window + keys), torch.arange(entry, entry + entries)])
            columns = columns.to(k.device)
            visible = scores.visible[:, :, tokens][..., columns]
            out[:, :, tokens] = masked_attention(
                q[:, :, tokens], k[:, :, columns], v[:, :, columns], visible, scores
            )
            window += keys
            entry += entries
        return out

    def mask(self, window: int, device: torch.device) -> torch.Tensor:
        """[1, 1, N, keys] additive: each row's window mask on its own queries and keys, -inf elsewhere."""
        blocks = [window_mask(position, length, window, device)[0, 0] for position, length, *_ in self.rows]
        mask = torch.full((sum(b.shape[0] for b in blocks), sum(b.shape[1] for b in blocks)), float("-inf"))
        row = column = 0
        for block in blocks:
            mask[row : row + block.shape[0], column : column + block.shape[1]] = block
            row += block.shape[0]
            column += block.shape[1]
        return mask.to(device)[None, None]


class RowwiseCompressor:
    """A DeepSeek-V4 compressor's forward that, given a `PackedRows` cache, runs each row alone with its
    own layer and lays the rows' compressed entries side by side, each row's queries masked to its own
    (its own causal mask, or all of them where the layer makes none: one query); else the compressor's."""

    def __init__(self, forward):
        self.forward = forward

    def __call__(self, hidden_states, q_residual, position_ids, cache, layer_idx: int):
        if not isinstance(cache, PackedRows):
            return self.forward(hidden_states, q_residual, position_ids, cache, layer_idx)
        spans = cache.spans()
        outputs = []
        for (_, _, layer, adapter), t in zip(cache.rows, spans, strict=True):
            # the row's tokens as a tensor of its own strides (torch's CPU bfloat16 linear is 30x slower on
            # a slice [:, a:b] of a packed [1, N, H], whose batch stride stays the pass's)
            row = (hidden_states[0, t][None], q_residual[0, t][None], position_ids[0, t][None])
            with use_adapters(adapter):
                outputs.append(self.forward(*row, RowCache({layer_idx: layer}), layer_idx))
        cache.entries = [kv.shape[2] for kv, _ in outputs]
        entries = torch.cat([kv for kv, _ in outputs], dim=2)
        bias = entries.new_full((1, 1, hidden_states.shape[1], entries.shape[2]), float("-inf"))
        column = 0
        for (kv, own), tokens in zip(outputs, spans, strict=True):
            columns = slice(column, column + kv.shape[2])
            bias[:, :, tokens, columns] = 0 if own is None else own
            column = columns.stop
        return entries, bias


def held_layers(hf: Any, blocks: nn.ModuleList) -> LayerMakers | None:
    """For a family whose attention keeps its own cache layers (DeepSeek-V4), their makers, each block's
    compressor made to run packed rows (`RowwiseCompressor`); None for any other family."""
    if not held_family(hf):
        return None
    for block in blocks:
        compressor = getattr(block.self_attn, "compressor", None)
        if compressor is not None and not isinstance(compressor.forward, RowwiseCompressor):
            compressor.forward = RowwiseCompressor(compressor.forward)
    return LayerMakers(hf)


class _OwnMask:
    """Attention under the mask the layer hands its attention function alone: its keys are the window's
    and the compressed entries', which positions do not order."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scores: Scores):
        return masked_attention(q, k, v, scores.visible, scores)


def window_mask(position: int, length: int, window: int, device: torch.device) -> torch.Tensor:
    """[1, 1, T, kept + T] additive: queries at [position, position + T) over the window's keys kept before
    them (the last window - 1) and their own, causal within the window (transformers' convention)."""
    kept = min(position, window - 1)
    queries = torch.arange(position, position + length, device=device)[:, None]
    keys = torch.arange(position - kept, position + length, device=device)[None, :]
    visible = (keys <= queries) & (keys > queries - window)
    mask = torch.zeros(visible.shape, device=device).masked_fill(~visible, float("-inf"))
    return mask[None, None]


def held_pass(
    block: nn.Module, hidden: torch.Tensor, context, first: int, inputs: dict, cache_name: str, makers
) -> torch.Tensor:
    """A DeepSeek-V4 block over a pass: the engine's sequence rows at once (`PackedRows`), each with its own
    cache layer from its states, kept after the pass; each root-to-leaf path of a token tree alone, from
    the row's layer, which it leaves as it was (engine/rows.py); a contiguous cache's batch of sequences
    with the layers it keeps; a pass over whole sequences with fresh ones."""
    index = block.self_attn.layer_idx
    window = block.self_attn.sliding_window
    groups = getattr(context, "row_groups", None)
    if groups is None:
        layers = getattr(context, "held_layers", {})
        if index not in layers:
            layers[index] = makers.fresh(index)
        mask = window_mask(getattr(context, "position", 0), hidden.shape[1], window, hidden.device)
        return _run(block, hidden, inputs, RowCache(layers), mask, first, cache_name)
    key = index - first  # as the rows' states are keyed (models/context_cache.py)
    out = torch.empty_like(hidden)
    sequences = []
    for group in groups.singly():
        row = group.rows[0]
        layer = _layer_of(row, key, index, makers)
        if row.tree is None:
            sequences.append((group, layer))
            continue
        tokens = group.tokens.to(hidden.device)
        rows, taken = one_row(hidden, inputs, tokens)
        mask = window_mask(row.position, len(tokens), window, hidden.device)
        with use_adapters(row.adapter):
            out[0, tokens] = _run(block, rows, taken, RowCache({index: layer}), mask, first, cache_name)[0]
    if sequences:
        tokens = torch.cat([group.tokens for group, _ in sequences]).to(hidden.device)
        rows, taken = one_row(hidden, inputs, tokens)
        packed = PackedRows([(g.rows[0].position, g.length, layer, g.adapter) for g, layer in sequences])
        mask = packed.mask(window, hidden.device)
        with use_adapters(packed.adapters()):  # the pass's adapters, as ranges of these tokens
            out[0, tokens] = _run(block, rows, taken, packed, mask, first, cache_name)[0]
        for (group, _), layer in zip(sequences, packed.layers, strict=True):
            group.rows[0].states[key] = hold(layer)
    return out


def _layer_of(row, key: int, index: int, makers: LayerMakers):
    """A row's cache layer for layer `index`: fresh at position 0, else restored from its states."""
    if row.position == 0:
        return makers.fresh(index)
    if row.states is None or key not in row.states:
        raise RuntimeError(f"a row at position {row.position} has no cache for layer {index}")
    return restore(row.states[key])


def _run(block, hidden, inputs: dict, cache: Cache, mask: torch.Tensor, first: int, cache_name: str):
    given = {**inputs, "attention_mask": mask.expand(hidden.shape[0], *mask.shape[1:]), cache_name: cache}
    with active_context(cache if isinstance(cache, PackedRows) else _OwnMask(), first):
        return run_block(block, hidden, given)
