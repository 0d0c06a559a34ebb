"""`ContextCache`: transformers' `Cache` interface over the active pass's attention context
(models/attention.py): keys and values, recurrent states (models/recurrent.py) and sparse attention's
indexer keys all go to the context that owns them."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, LinearAttentionLayer

from corolla.errors import UnsupportedModel
from corolla.models.attention import current_pass
from corolla.models.recurrent import FreshStates


class ContextCache(Cache):
    """transformers' cache interface over the active pass: `update` stores the new keys and values and
    returns them unchanged (the attention function reads the rest from the context), or, for a gathering
    layer, returns every position's.

    Linear-attention, Mamba and convolution layers (models/recurrent.py) get their state from the
    context's `linear_state(layer)`: a transformers `LinearAttentionLayer` holding the states of the rows
    being run, or None when the pass keeps no state (whole sequences from position 0: a fresh one).

    `get_seq_length` answers `length`: 0, or the first position of the one row a pass runs where a layer
    counts its queries' positions from it (Llama 4's NoPE layers: row_passes.positioned_pass).

    `layers[i]` answers for a sparse-attention layer once its indexer keys are stored: how many positions
    the row's cache holds (GLM-5-Next's indexer reads `layers[i].keys.shape[-2]` and `get_seq_length()`)."""

    def __init__(self, number_of_states: int = 1):
        super().__init__(layers=[])
        self.fresh = FreshStates(number_of_states)
        self.layers = _IndexedLengths()
        self.length = 0

    def __getattr__(self, name: str):
        """What transformers' `Cache` has not and corolla's does not keep (MiniMax's `get_linear_cache`):
        refused naming it (an AttributeError too, so that `hasattr` answers False)."""
        if name.startswith("__"):
            raise AttributeError(name)
        raise _NotKept(f"a layer asked the cache for `{name}`, which corolla's cache does not keep")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        current = current_pass()
        return current.context.store(layer_idx - current.first_layer, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def _linear(self, layer_idx: int) -> LinearAttentionLayer:
        current = current_pass()
        states = getattr(current.context, "linear_state", None)
        if states is None:
            raise UnsupportedModel(
                f"layer {layer_idx} keeps a recurrent state, which a {type(current.context).__name__} "
                "does not hold"
            )
        layer = states(layer_idx - current.first_layer)
        return self.fresh.linear_state(layer_idx) if layer is None else layer

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        layer = self._linear(layer_idx)
        return layer.conv_states[state_idx] if layer.has_previous_state[state_idx] else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        layer = self._linear(layer_idx)
        return layer.recurrent_states[state_idx] if layer.has_previous_state[state_idx] else None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._linear(layer_idx).update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        return self._linear(layer_idx).update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if layer_idx is None:
            raise ValueError("corolla's cache answers has_previous_state for a named layer only")
        previous = self._linear(layer_idx).has_previous_state
        return all(previous.values()) if state_idx is None else previous[state_idx]

    def is_recording_past(self, layer_idx: int) -> bool:
        return False  # earlier states are kept by the engine (snapshots), not by growing conv states

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """DeepSeek sparse attention's indexer keys [B, T, D]: stored, and every position's returned."""
        current = current_pass()
        store = getattr(current.context, "store_indexer", None)
        if store is None:
            raise UnsupportedModel(f"a {type(current.context).__name__} holds no indexer keys")
        history = store(layer_idx - current.first_layer, indexer_key_states)
        self.layers[layer_idx].keys = history
        return history


class _NotKept(UnsupportedModel, AttributeError):
    pass


class _Stored:
    """A sparse-attention layer's cache as its indexer reads it (GLM-5-Next takes the layer before it
    stores): `keys` [B, positions, D], the indexer keys stored so far, and their number."""

    keys: torch.Tensor | None = None

    def get_seq_length(self) -> int:
        if self.keys is None:
            raise UnsupportedModel("a sparse-attention layer read its cache before storing its indexer keys")
        return self.keys.shape[-2]


class _IndexedLengths(dict):
    def __missing__(self, layer_idx: int) -> _Stored:
        self[layer_idx] = _Stored()
        return self[layer_idx]
