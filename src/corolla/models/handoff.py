"""What travels between spans: the hidden states one layer hands the next, as one [B, T, width] tensor.

For most families that is the hidden states themselves (width = hidden_size). Two of this year's
layouts hand their layers more:
- per-layer inputs (Gemma 3n, Gemma 4 E2B/E4B: `hidden_size_per_layer_input`): every layer also takes
  a small vector per token made from the token id and its embedding, which only the head can compute
  (it holds the embeddings). The head computes all layers' vectors once and they travel beside the
  hidden states, [num_layers * per_layer] more floats per token; each span reads its own layers'.
- parallel streams: the residual is `streams` copies of the hidden states between layers, Gemma 3n's
  AltUp (`altup_num_inputs`) as [streams, B, T, hidden], the hyper-connections of HY-V4 (`hc_mult`) as
  [B, T, streams, hidden]; the head makes them from the embedding and merges them back before the final
  norm.
- a state each layer hands the next (ZAYA's router states: every layer's router adds the previous
  layer's, `prev_router_hidden_states`, and returns its own): [handed] floats per token after the hidden
  states, zeros into the model's first layer (whose router reads none), dropped after the last.

Everything that carries hidden states (steps, pushes, replays, spot checks, forward and backward
passes) carries this tensor unchanged; only a span unpacks it (`unpack`) around its layers and packs it
again (`pack`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from corolla.errors import UnsupportedModel

# the decoder's modules outside its layers that make or merge what travels between spans (the head's)
WIRE_MODULES = (
    "embed_tokens_per_layer",
    "per_layer_model_projection",
    "per_layer_projection_norm",
    "altup_projections",
    "altup_unembed_projections",
    "hc_head",
)


# the input a layer takes from the layer before it besides the hidden states and returns after them (ZAYA)
HANDED_INPUT = "prev_router_hidden_states"


def wire_modules(decoder: nn.Module) -> dict[str, nn.Module]:
    """Those of WIRE_MODULES the decoder has, by name."""
    return {name: getattr(decoder, name) for name in WIRE_MODULES if hasattr(decoder, name)}


@dataclass(frozen=True)
class WireLayout:
    hidden_size: int
    streams: int = 1  # parallel residual streams (AltUp, hyper-connections); 1: plain hidden states
    streams_first: bool = True  # streams before the batch (AltUp) or after the tokens (hyper-connections)
    per_layer: int = 0  # each layer's per-layer input width (0: none)
    num_layers: int = 0  # layers with a per-layer input (the model's)
    handed: int = 0  # the width of the state each layer hands the next (0: none)

    @classmethod
    def of(cls, hf: Any) -> WireLayout:
        """The layout of a transformers text config."""
        per_layer = int(getattr(hf, "hidden_size_per_layer_input", None) or 0)
        hyper = int(getattr(hf, "hc_mult", None) or 1)
        streams = hyper if hyper > 1 else int(getattr(hf, "altup_num_inputs", None) or 1)
        handed = int(getattr(hf, "router_hidden_size", None) or 0)  # ZAYA's router states
        if handed and (streams > 1 or per_layer):
            raise UnsupportedModel(f"{hf.model_type}: a handed state beside streams or per-layer inputs")
        return cls(
            hidden_size=int(hf.hidden_size),
            streams=streams,
            streams_first=hyper == 1,
            per_layer=per_layer,
            num_layers=int(hf.num_hidden_layers) if per_layer else 0,
            handed=handed,
        )

    @property
    def width(self) -> int:
        """Floats per token on the wire."""
        return self.streams * self.hidden_size + self.handed + self.num_layers * self.per_layer

    @property
    def carries(self) -> tuple[str, ...]:
        """The layers' inputs besides the hidden states that travel on the wire."""
        return (HANDED_INPUT,) if self.handed else ()

    @property
    def plain(self) -> bool:
        return self.width == self.hidden_size

    def pack(self, hidden: torch.Tensor, per_layer_inputs: torch.Tensor | None) -> torch.Tensor:
        """hidden [B, T, H] (or its streams) and per-layer inputs [B, T, layers, per_layer] -> [B, T, W]."""
        if self.plain:
            return hidden
        if self.streams > 1:
            hidden = (hidden.permute(1, 2, 0, 3) if self.streams_first else hidden).flatten(2)
        if per_layer_inputs is None:
            return hidden
        return torch.cat([hidden, per_layer_inputs.flatten(2).to(hidden.dtype)], dim=-1)

    def unpack(self, wire: torch.Tensor, handed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T, width] -> (hidden [B, T, H] or its streams, followed by the handed state where the family
        hands one and `handed` asks for it; per-layer inputs or None)."""
        if self.plain:
            return wire, None
        split = self.streams * self.hidden_size + (self.handed if handed else 0)
        hidden = wire[..., :split]
        if self.streams > 1:
            hidden = hidden.unflatten(-1, (self.streams, self.hidden_size))
            hidden = hidden.permute(2, 0, 1, 3) if self.streams_first else hidden
        if not self.per_layer:
            return hidden, None
        return hidden, wire[..., split:].unflatten(-1, (self.num_layers, self.per_layer))


def with_handed(hidden: torch.Tensor, wire: WireLayout) -> torch.Tensor:
    """What the model's first layer receives, [B, T, H] -> [B, T, H + handed]: no state handed to it."""
    return torch.nn.functional.pad(hidden, (0, wire.handed)) if wire.handed else hidden


class HandingLayer:
    """A layer that takes the state the layer before it handed on and returns its own beside its hidden
    states (ZAYA's `prev_router_hidden_states`), called as a layer taking and returning [B, T, H + handed]
    tensors, so that row-by-row passes (models/row_passes.py) split and gather the state with the hidden
    states. The state enters the layer in the computation's dtype: ZAYA keeps its residual in float32."""

    def __init__(self, layer: nn.Module, hidden_size: int, dtype: torch.dtype):
        self.layer = layer
        self.hidden_size = hidden_size
        self.dtype = dtype

    def __call__(self, wire: torch.Tensor, **inputs) -> torch.Tensor:
        hidden = wire[..., : self.hidden_size]
        handed = wire[..., self.hidden_size :]
        out, handed = self.layer(hidden, **{HANDED_INPUT: handed.to(self.dtype)}, **inputs)
        return torch.cat([out, handed.to(out.dtype)], dim=-1)


def merge_streams(streams: torch.Tensor, projections: nn.ModuleList) -> torch.Tensor:
    """AltUp's parallel streams [S, B, T, H] back to hidden states [B, T, H], as Gemma 3n's text model
    does before its final norm (transformers does it inline in the model's forward): each stream after
    the first projected and scaled to the first's magnitude, then all averaged."""
    target_magnitude = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
    merged = [streams[0]]
    for stream, projection in zip(streams[1:], projections, strict=True):
        projected = projection(stream)
        magnitude = torch.sqrt(torch.mean(projected**2, dim=-1, keepdim=True).clamp(min=1e-5))
        merged.append(projected * target_magnitude / magnitude)
    return torch.mean(torch.stack(merged), dim=0)
