"""How a family's own decoder calls its layers, where a span must call them the same way: under which
name it hands the cache, which layers it hands position embeddings, and the layer index that shared
modules are told only when called.

Most of this is in the layers' signatures; what the decoder's forward decides itself (LaraMini's global
layers get no position embeddings, LFM3's convolutions none) is learned by running that forward over one
token with every layer replaced by a recorder (`rotary_given`), as ModelHead.embed learns what the first
layer receives."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from corolla.errors import UnsupportedModel

_NOT_GIVEN = object()


class _Unknown(Exception):
    """The recorded forward cannot go on as the real one would."""


class _Recorder(nn.Module):
    """Stands in for decoder layer `index`: notes its call (whether it was handed position embeddings,
    and whether it received what the layer before it returned) and returns its input plus one, so that
    the next layer's input tells whether the decoder's forward changed it in between."""

    def __init__(self, layer: nn.Module, index: int, calls: list):
        super().__init__()
        self._layer = [layer]  # a list: not a submodule; what the decoder reads of it (Dory: attention_type)
        self.index = index
        self.calls = calls

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_layer"][0], name)

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        previous = self.calls[-1][2] if self.calls else None
        if previous is not None and hidden.shape != previous.shape:
            raise _Unknown  # the decoder took part of a layer's output (Falcon-H1: `outputs[0]` of a tuple)
        handed = previous is None or torch.equal(hidden, previous)
        given = kwargs.get("position_embeddings", _NOT_GIVEN) is not None
        self.calls.append((self.index, given, hidden + 1, handed))
        return self.calls[-1][2]


def rotary_given(
    decoder: nn.Module, hidden_size: int, dtype: torch.dtype, model_type: str
) -> tuple[bool, ...] | None:
    """For each of the decoder's layers, whether its own forward hands it position embeddings (None
    where that forward does not reach every layer from the embeddings alone: Gemma 3n's per-layer inputs,
    layers returning more than their hidden states; then every layer gets its type's, as before). A
    forward that runs its layers otherwise than each once, in order, each on what the one before returned
    (Dory loops some of them, renormalized, over the input section's output) is refused: spans cannot."""
    layers = decoder.layers
    calls: list = []
    decoder.layers = nn.ModuleList(_Recorder(layer, index, calls) for index, layer in enumerate(layers))
    try:
        with torch.no_grad():
            decoder(inputs_embeds=torch.zeros(1, 1, hidden_size, dtype=dtype), use_cache=False)
    except Exception:  # the final norm's meta weights, or a forward that needs more than embeddings
        pass
    finally:
        decoder.layers = layers
    order = [index for index, *_ in calls]
    if order != list(range(len(order))) or not all(handed for *_, handed in calls):
        raise UnsupportedModel(
            f"{model_type}: its decoder does not run each layer once, in order, on what the layer before "
            f"returned (called: {order[:12]}{'...' if len(order) > 12 else ''}), which spans cannot split"
        )
    return tuple(given for _, given, *_ in calls) if len(calls) == len(layers) else None


def typed(rotary: nn.Module | None) -> bool:
    """Whether a rotary embedding computes per layer type (Gemma 3's, LFM3's: `layer_type`)."""
    return rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters


def index_shared_attention(blocks: nn.ModuleList, start: int) -> nn.ModuleList:
    """Zamba2's shared attention blocks are built with layer_idx -1 and told their layer when called,
    which the cache hears but the attention function does not: each copy gets its block's index (the
    blocks share weights, not modules)."""
    for index, block in enumerate(blocks, start):
        for module in block.modules():
            if getattr(module, "layer_idx", None) == -1:
                module.layer_idx = index
    return blocks


def cache_kwarg(block: nn.Module) -> str:
    """The name a family's decoder layer takes its cache under (`cache` in most of transformers 5)."""
    parameters = inspect.signature(block.forward).parameters
    return next((n for n in ("cache", "past_key_values", "layer_past") if n in parameters), "cache")
