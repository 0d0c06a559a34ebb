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
- an input every layer takes beside the hidden states, handed from layer to layer after them ([handed]
  floats per token): ZAYA's router state (each layer's router adds the previous layer's,
  `prev_router_hidden_states`, and returns its own; zeros into the model's first layer, whose router reads
  none), Zamba's embeddings' output (`original_hidden_states`, which each shared attention block reads
  beside the hidden states: the same for every layer). The last layer's is dropped.
- the token ids, where layers route by them (DeepSeek-V4's hash-routed MoE layers pick their experts by
  `input_ids`): each id as ID_DIGITS base-256 digits, which every float dtype of the wire holds exactly.

Everything that carries hidden states (steps, pushes, replays, spot checks, forward and backward
passes) carries this tensor unchanged; only a span unpacks it (`unpack`) around its layers and packs it
again (`pack`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from corolla.errors import InvalidRequest, UnsupportedModel

# the decoder's modules outside its layers that make or merge what travels between spans (the head's)
WIRE_MODULES = (
    "embed_tokens_per_layer",
    "per_layer_model_projection",
    "per_layer_projection_norm",
    "altup_projections",
    "altup_unembed_projections",
    "hc_head",
)


# inputs a family's layers take beside the hidden states that travel with them, by the config field that
# marks the family: the field giving its width per token (None: the hidden size), the layers' argument,
# and whether a layer returns its own for the next (ZAYA) or hands on what it was given (Zamba2). Zamba
# v1's layers share one attention module object, which corolla does not split between blocks: refused
HANDED = {
    "router_hidden_size": ("router_hidden_size", "prev_router_hidden_states", True),  # ZAYA's router states
    "num_mem_blocks": (None, "original_hidden_states", False),  # Zamba2's embeddings' output
}
# token ids travel as digits in base 256, exact in bfloat16 and float16 (integers up to 256 and 2048)
ID_DIGITS = 3
ID_BASE = 256


def routes_by_ids(hf: Any) -> bool:
    """Whether a family's layers pick experts by the token ids (DeepSeek-V4's `hash_moe` layers)."""
    return "hash_moe" in (getattr(hf, "mlp_layer_types", None) or ())


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
    handed: int = 0  # the width of the input handed from layer to layer beside the hidden states (0: none)
    handed_input: str = ""  # the layers' argument it is (HANDED)
    handed_back: bool = False  # each layer returns its own (ZAYA) rather than handing on what it got
    token_ids: int = 0  # floats per token carrying its id (ID_DIGITS where layers route by ids; 0: none)
    vocab_size: int = 0  # the ids' bound, where they travel

    @classmethod
    def of(cls, hf: Any) -> WireLayout:
        """The layout of a transformers text config."""
        per_layer = int(getattr(hf, "hidden_size_per_layer_input", None) or 0)
        hyper = int(getattr(hf, "hc_mult", None) or 1)
        streams = hyper if hyper > 1 else int(getattr(hf, "altup_num_inputs", None) or 1)
        marker = next((name for name in HANDED if getattr(hf, name, None)), None)
        width_field, handed_input, handed_back = HANDED.get(marker, (None, "", False))
        handed = 0 if marker is None else int(getattr(hf, width_field or "hidden_size"))
        if handed and (streams > 1 or per_layer):
            raise UnsupportedModel(f"{hf.model_type}: a handed input beside streams or per-layer inputs")
        token_ids = ID_DIGITS if routes_by_ids(hf) else 0
        if token_ids and int(hf.vocab_size) > ID_BASE**ID_DIGITS:
            raise UnsupportedModel(
                f"{hf.model_type}: token ids of {hf.vocab_size} do not fit the wire's digits"
            )
        return cls(
            hidden_size=int(hf.hidden_size),
            streams=streams,
            streams_first=hyper == 1,
            per_layer=per_layer,
            num_layers=int(hf.num_hidden_layers) if per_layer else 0,
            handed=handed,
            handed_input=handed_input,
            handed_back=handed_back,
            token_ids=token_ids,
            vocab_size=int(hf.vocab_size) if token_ids else 0,
        )

    @property
    def width(self) -> int:
        """Floats per token on the wire."""
        return (
            self.streams * self.hidden_size + self.handed + self.token_ids + self.num_layers * self.per_layer
        )

    @property
    def carries(self) -> tuple[str, ...]:
        """The layers' inputs besides the hidden states that travel on the wire."""
        return ((self.handed_input,) if self.handed else ()) + (("input_ids",) if self.token_ids else ())

    @property
    def plain(self) -> bool:
        return self.width == self.hidden_size

    def pack(
        self, hidden: torch.Tensor, per_layer_inputs: torch.Tensor | None, ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [B, T, H] (or its streams), the token ids [B, T] where they travel and per-layer inputs
        [B, T, layers, per_layer] -> [B, T, W]."""
        if self.plain:
            return hidden
        if self.streams > 1:
            hidden = (hidden.permute(1, 2, 0, 3) if self.streams_first else hidden).flatten(2)
        parts = [hidden]
        if self.token_ids:
            digits = [ids // ID_BASE**k % ID_BASE for k in reversed(range(self.token_ids))]
            parts.append(torch.stack(digits, dim=-1).to(hidden.device, hidden.dtype))
        if per_layer_inputs is not None:
            parts.append(per_layer_inputs.flatten(2).to(hidden.dtype))
        return torch.cat(parts, dim=-1) if len(parts) > 1 else hidden

    def sample(self, *shape: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Random wire tensors [*shape, width] (float32) for measurements and tests: normal hidden states,
        and valid token ids where they travel."""
        wire = torch.randn(*shape, self.width, generator=generator)
        if self.token_ids:
            ids = torch.randint(0, self.vocab_size, shape, generator=generator)
            hidden, per_layer_inputs = self.unpack(wire, handed=True)
            wire = self.pack(hidden, per_layer_inputs, ids)
        return wire

    @property
    def ids_start(self) -> int:
        """Where the token ids' digits begin among a token's floats (after the streams and handed input)."""
        return self.streams * self.hidden_size + self.handed

    def check_ids(self, wire: torch.Tensor) -> None:
        """Refuse a peer's wire tensor whose token-id digits are not ids of the vocabulary."""
        if not self.token_ids:
            return
        start = self.ids_start
        digits = wire[..., start : start + self.token_ids].float()
        if not bool(((digits >= 0) & (digits < ID_BASE) & (digits == digits.round())).all()):
            raise InvalidRequest(
                f"hidden_states: floats {start}..{start + self.token_ids - 1} of each token must be its id's "
                f"base-{ID_BASE} digits"
            )
        if int(self.ids(wire).max()) >= self.vocab_size:
            raise InvalidRequest(f"hidden_states: a token id is not below the vocabulary's {self.vocab_size}")

    def ids(self, wire: torch.Tensor) -> torch.Tensor | None:
        """The token ids [B, T] (int64) a wire tensor carries, or None where they do not travel."""
        if not self.token_ids:
            return None
        start = self.ids_start
        digits = wire[..., start : start + self.token_ids].detach().float().round().long()
        return sum(digits[..., k] * ID_BASE ** (self.token_ids - 1 - k) for k in range(self.token_ids))

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
        per_layer_inputs = wire[..., self.ids_start + self.token_ids :]
        return hidden, per_layer_inputs.unflatten(-1, (self.num_layers, self.per_layer))


def with_handed(hidden: torch.Tensor, wire: WireLayout, first: bool = True) -> torch.Tensor:
    """[B, T, H] -> [B, T, H + handed]: what the model's first layer receives (`first`: Zamba's embeddings'
    output is the embeddings themselves, ZAYA's router state none), or an addition to the hidden states
    that leaves the handed input as it is (deep prompts)."""
    if not wire.handed:
        return hidden
    if first and not wire.handed_back:
        return torch.cat([hidden, hidden], dim=-1)
    return torch.nn.functional.pad(hidden, (0, wire.handed))


class HandingLayer:
    """A layer that takes an input beside the hidden states from the layer before it (models/handoff.py:
    ZAYA's router state, Zamba's embeddings' output), called as a layer taking and returning
    [B, T, H + handed] tensors, so that row-by-row passes (models/row_passes.py) split and gather it with
    the hidden states. It enters the layer in the computation's dtype (ZAYA keeps its residual in
    float32); layers that take their own index (Zamba's shared blocks pick their adapters by it) get it."""

    def __init__(self, layer: nn.Module, wire: WireLayout, dtype: torch.dtype, index: int):
        self.layer = layer
        self.wire = wire
        self.dtype = dtype
        self.extra = {"layer_idx": index} if _takes_index(type(layer)) else {}

    def __call__(self, wire: torch.Tensor, **inputs) -> torch.Tensor:
        hidden = wire[..., : self.wire.hidden_size]
        handed = wire[..., self.wire.hidden_size :]
        out = self.layer(hidden, **{self.wire.handed_input: handed.to(self.dtype)}, **self.extra, **inputs)
        if self.wire.handed_back:
            out, handed = out
        elif isinstance(out, tuple):
            out = out[0]
        return torch.cat([out, handed.to(out.dtype)], dim=-1)


@functools.cache
def _takes_index(layer_class: type) -> bool:
    """Whether a layer class's forward takes its own index (read once per class: a span wraps its layers
    in a HandingLayer on every pass)."""
    return "layer_idx" in inspect.signature(layer_class.forward).parameters


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
