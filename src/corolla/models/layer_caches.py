"""Layers whose cache is transformers' own cache layer object, one per sequence: DeepSeek-V4's attention.

Its layers keep what no page of keys holds: a sliding window of keys (which are also its values), and
in its compressed layers one compressed entry every m tokens (CSA: m = 4, with a lightning indexer's own
compressed keys; HCA: m = 128), with the compressor's buffer of tokens since the last full window and the
overlap its windows share. Its code reads and writes them through its own cache layer classes
(`cache.layers[i].store_compression_weights`, ...), concatenates the compressed entries onto its keys and
masks them itself, so such a block runs one sequence at a time with that sequence's own layer object,
and attends under the mask the layer builds (`_OwnMask`).

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
    """A DeepSeek-V4 block over a pass: each engine row (each root-to-leaf path of a token tree) with its
    own cache layer from its states, kept where the row moves on (engine/rows.py); a contiguous cache's
    batch of sequences with the layers it keeps; a pass over whole sequences with fresh ones."""
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
    for group in groups.singly():
        row = group.rows[0]
        if row.position == 0:
            layer = makers.fresh(index)
        elif row.states is None or key not in row.states:
            raise RuntimeError(f"a row at position {row.position} has no cache for layer {index}")
        else:
            layer = restore(row.states[key])
        tokens = group.tokens.to(hidden.device)
        rows, taken = one_row(hidden, inputs, tokens)
        mask = window_mask(row.position, len(tokens), window, hidden.device)
        with use_adapters(row.adapter):
            out[0, tokens] = _run(block, rows, taken, RowCache({index: layer}), mask, first, cache_name)[0]
        if group.write:
            row.states[key] = hold(layer)
    return out


def _run(block, hidden, inputs: dict, cache: RowCache, mask: torch.Tensor, first: int, cache_name: str):
    given = {**inputs, "attention_mask": mask.expand(hidden.shape[0], *mask.shape[1:]), cache_name: cache}
    with active_context(_OwnMask(), first):
        return run_block(block, hidden, given)
