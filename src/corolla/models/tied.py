"""Modules a checkpoint stores once, under one block, and the model ties to later blocks (Zamba2's shared
attention blocks: the decoder's `_tied_weights_keys`): a span reads them from where they are stored, and
holds one copy of their weights however many of its blocks use them."""

from __future__ import annotations

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping

from corolla.models.checkpoint import Checkpoint
from corolla.models.loading import decoder_of, load_converted


def load_tied(
    model: nn.Module, checkpoint: Checkpoint, index: int, dtype: torch.dtype, loaded: dict | None = None
) -> None:
    """Block `index`'s modules whose weights the checkpoint stores once, under an earlier block (Zamba's
    shared attention blocks, tied by the decoder's `_tied_weights_keys`), read from there; with `loaded`
    (the source module path -> the module this span already holds it in, updated here), a module whose
    weights the span holds already shares them instead of holding a copy."""
    prefix, decoder = decoder_of(model)
    state_dict = {}
    for target, source in (getattr(decoder, "_tied_weights_keys", None) or {}).items():
        if not target.startswith(f"layers.{index}."):
            continue
        held = _held(decoder, source, loaded)
        if held is not None:
            _share(decoder.get_submodule(target), held)
            continue
        if loaded is not None:
            loaded[source] = decoder.get_submodule(target)
        stored = f"{checkpoint.prefix}{source}."
        names = [name for name in checkpoint.weight_map if name.startswith(stored)]
        for name, tensor in checkpoint.read(names, owned=True).items():
            state_dict[f"{prefix}{target}.{name[len(stored) :]}"] = tensor
    if state_dict:
        load_converted(model, state_dict, get_model_conversion_mapping(model), dtype, checkpoint)


def _share(target: nn.Module, source: nn.Module) -> None:
    """`target` holds `source`'s parameters and buffers themselves (tied modules: one copy in memory)."""
    for name, tensor in [*source.named_parameters(), *source.named_buffers()]:
        owner, _, leaf = name.rpartition(".")
        setattr(target.get_submodule(owner) if owner else target, leaf, tensor)


def _held(decoder: nn.Module, source: str, loaded: dict | None) -> nn.Module | None:
    """The module of this span already holding `source`'s weights: the source itself where the span holds
    its block, or the first block that read them; None where they must be read (or are not to be shared)."""
    if loaded is None:
        return None
    module = decoder.get_submodule(source)
    if not any(p.is_meta for p in module.parameters()):
        return module
    return loaded.get(source)
