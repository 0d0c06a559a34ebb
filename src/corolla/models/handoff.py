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

Everything that carries hidden states (steps, pushes, replays, spot checks, forward and backward
passes) carries this tensor unchanged; only a span unpacks it (`unpack`) around its layers and packs it
again (`pack`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# the decoder's modules outside its layers that make or merge what travels between spans (the head's)
WIRE_MODULES = (
    "embed_tokens_per_layer",
    "per_layer_model_projection",
    "per_layer_projection_norm",
    "altup_projections",
    "altup_unembed_projections",
    "hc_head",
)


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

    @classmethod
    def of(cls, hf: Any) -> WireLayout:
        """The layout of a transformers text config."""
        per_layer = int(getattr(hf, "hidden_size_per_layer_input", None) or 0)
        hyper = int(getattr(hf, "hc_mult", None) or 1)
        return cls(
            hidden_size=int(hf.hidden_size),
            streams=hyper if hyper > 1 else int(getattr(hf, "altup_num_inputs", None) or 1),
            streams_first=hyper == 1,
            per_layer=per_layer,
            num_layers=int(hf.num_hidden_layers) if per_layer else 0,
        )

    @property
    def width(self) -> int:
        """Floats per token on the wire."""
        return self.streams * self.hidden_size + self.num_layers * self.per_layer

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

    def unpack(self, wire: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T, width] -> (hidden [B, T, H] or its streams, per-layer inputs or None)."""
        if self.plain:
            return wire, None
        split = self.streams * self.hidden_size
        hidden = wire[..., :split]
        if self.streams > 1:
            hidden = hidden.unflatten(-1, (self.streams, self.hidden_size))
            hidden = hidden.permute(2, 0, 1, 3) if self.streams_first else hidden
        if not self.per_layer:
            return hidden, None
        return hidden, wire[..., split:].unflatten(-1, (self.num_layers, self.per_layer))


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
