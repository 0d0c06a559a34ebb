"""Per-session state of linear-attention, Mamba and short-convolution layers (Qwen3.5 and Qwen3-Next's
Gated DeltaNet, Jamba and Nemotron-H's Mamba, LFM2's convolutions), kept through transformers' own cache
layer for them.

Such a layer keeps no keys and values per token: it carries a fixed-size state from token to token (a
convolution's last inputs and a recurrent matrix). transformers' layers read and write it through
`Cache.get_conv_state` / `update_conv_state` / `get_recurrent_state` / `update_recurrent_state`, which
`ContextCache` (models/attention.py) hands to the pass's context. The context builds one
`LinearAttentionLayer` (transformers' class) per layer from the states of the rows it runs together, and
reads the new states back from it afterwards.

A row's state for one layer is a `LayerState`: values, never changed in place (a pass works on copies),
so the engine keeps an earlier state (a snapshot at a step's start) by keeping a reference to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import LinearAttentionLayer

# layer types whose blocks keep no attention cache, or a recurrent state instead (models/model_config.py)
STATE_LAYER_TYPES = ("linear_attention", "conv")
STATELESS_LAYER_TYPES = ("mlp", "moe")


@dataclass(frozen=True, slots=True)
class LayerState:
    """One row's state of one layer: per state index, the convolution's last inputs [1, channels, kernel]
    and the recurrent state [1, ...] (None where the layer keeps none)."""

    conv: tuple[torch.Tensor | None, ...]
    recurrent: tuple[torch.Tensor | None, ...]

    @property
    def nbytes(self) -> int:
        tensors = [t for t in (*self.conv, *self.recurrent) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


RowStates = dict[int, LayerState]  # a row's state per layer (the layer's absolute index)


def cache_layer(states: list[LayerState] | None, number_of_states: int) -> LinearAttentionLayer:
    """transformers' cache layer holding the states of rows run together (a copy: the layer updates it in
    place), or an empty one for rows that start at position 0 (`states` None)."""
    layer = LinearAttentionLayer(number_of_states=number_of_states)
    if states is None:
        return layer
    for index in range(number_of_states):
        conv = [state.conv[index] for state in states]
        if conv[0] is not None:
            layer.conv_states[index] = torch.cat(conv)
            layer.conv_kernel_size[index] = conv[0].shape[-1]
            layer.is_conv_states_initialized[index] = True
        recurrent = [state.recurrent[index] for state in states]
        if recurrent[0] is not None:
            layer.recurrent_states[index] = torch.cat(recurrent)
            layer.is_recurrent_states_initialized[index] = True
        layer.has_previous_state[index] = conv[0] is not None or recurrent[0] is not None
        first = conv[0] if conv[0] is not None else recurrent[0]
        if first is not None:
            layer.dtype = first.dtype
            layer.device = first.device
    return layer


def row_states(layer: LinearAttentionLayer, rows: int) -> list[LayerState]:
    """The rows' new states after a pass, one LayerState per row (each row's own slice)."""
    count = layer.number_of_states
    conv = [_rows(layer.conv_states[i], rows) for i in range(count)]
    recurrent = [_rows(layer.recurrent_states[i], rows) for i in range(count)]
    return [LayerState(tuple(c[row] for c in conv), tuple(r[row] for r in recurrent)) for row in range(rows)]


def _rows(tensor: torch.Tensor | None, rows: int) -> list[torch.Tensor | None]:
    if tensor is None:
        return [None] * rows
    if rows == 1:
        return [tensor]  # the pass's own copy
    return [tensor[row : row + 1].clone() for row in range(rows)]


class FreshStates:
    """The states of a pass over whole sequences from position 0 (nothing kept after it): an empty
    cache layer per layer, made when first asked for."""

    def __init__(self, number_of_states: int = 1):
        self.number_of_states = number_of_states
        self.layers: dict[int, LinearAttentionLayer] = {}

    def linear_state(self, layer: int) -> LinearAttentionLayer:
        if layer not in self.layers:
            self.layers[layer] = cache_layer(None, self.number_of_states)
        return self.layers[layer]
