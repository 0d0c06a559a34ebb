"""How a family's own decoder calls its layers, where a span must call them the same way: under which
name it hands the cache, which layers it hands position embeddings, and the layer index that shared
modules are told only when called.

Most of this is in the layers' signatures; what the decoder's forward decides itself (LaraMini's global
layers get no position embeddings, LFM3's convolutions none) is learned by running that forward over one
token with every layer replaced by a recorder (`rotary_feeds`), as ModelHead.embed learns what the first
layer receives."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from corolla.errors import UnsupportedModel

CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")  # a layer's cache, by family and age
BY_TYPE = "by type"  # a layer handed the span's rotary embedding for its type (the default)
# a layer handed every type's of the rotary embedding, by type (DeepSeek-V4's "main" and "compress")
ALL_TYPES = "all types"


class _Unknown(Exception):
    """The recorded forward cannot go on as the real one would."""


class _Recorder(nn.Module):
    """Stands in for decoder layer `index`: notes its call (the position embeddings it was handed, and
    whether it received what the layer before it returned) and returns its input plus one, so that the
    next layer's input tells whether the decoder's forward changed it in between."""

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
        self.calls.append((self.index, kwargs.get("position_embeddings", BY_TYPE), hidden + 1, handed))
        return self.calls[-1][2]


def rotary_feeds(
    decoder: nn.Module, hidden_size: int, dtype: torch.dtype, model_type: str
) -> tuple[nn.ModuleList, tuple | None]:
    """The decoder's rotary embeddings, and for each of its layers what its own forward hands it: None (no
    position embeddings: LaraMini's global layers, LFM3's convolutions, GraniteSWA's NoPE layers), k (the
    (cos, sin) of rotary embedding k: GraniteSWA's one per base) or BY_TYPE (the span's rotary embedding for
    the layer's type, as before). None for the whole where that forward does not reach every layer from
    the embeddings alone (Gemma 3n's per-layer inputs, layers returning more than their hidden states). A
    forward that runs its layers otherwise than each once, in order, each on what the one before returned
    (Dory loops some of them, renormalized, over the input section's output) is refused: spans cannot."""
    layers = decoder.layers
    calls: list = []
    decoder.layers = nn.ModuleList(_Recorder(layer, index, calls) for index, layer in enumerate(layers))
    x = torch.zeros(1, 2, hidden_size, dtype=dtype)  # two positions: bases differ from position 1 on
    try:
        with torch.no_grad():
            decoder(inputs_embeds=x, use_cache=False)
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
    rotaries = nn.ModuleList(rotary_modules(decoder))
    if len(calls) != len(layers):
        return rotaries, None
    outputs = [_embeddings(rotary, x) for rotary in rotaries]
    return rotaries, tuple(_feed(given, outputs) for _, given, *_ in calls)


def rotary_modules(decoder: nn.Module) -> list[nn.Module]:
    """The decoder's `rotary_emb` and `...RotaryEmbedding` children, also those in a list (GraniteSWA's
    `rotary_embs`)."""
    own = getattr(decoder, "rotary_emb", None)
    found = [own] if isinstance(own, nn.Module) else []
    for child in decoder.children():
        inside = child.children() if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child]
        found += [m for m in inside if type(m).__name__.endswith("RotaryEmbedding") and m is not own]
    return found


def _embeddings(rotary: nn.Module, x: torch.Tensor):
    """An untyped rotary embedding's (cos, sin) for positions 0 and 1 (None: typed, or learned weights
    still on the meta device)."""
    if typed(rotary) or any(p.is_meta for p in rotary.parameters()):
        return None
    with torch.no_grad():
        return rotary(x, torch.arange(x.shape[1])[None])


def _feed(given, outputs: list):
    if given is None or given is BY_TYPE:
        return given
    if isinstance(given, dict):
        return ALL_TYPES
    for k, output in enumerate(outputs):
        comparable = isinstance(given, tuple) and output is not None and len(given) == len(output)
        if comparable and all(torch.equal(a, b) for a, b in zip(given, output, strict=True)):
            return k
    return BY_TYPE


def block_rotaries(
    rotary: nn.Module | None,
    rotaries: nn.ModuleList,
    feeds: tuple,
    layer_types: tuple[str, ...],
    hidden: torch.Tensor,
    position_ids: torch.Tensor,
    first: int,
    last: int,
) -> list:
    """What a family's model hands each of blocks [first, last) (`feeds`: rotary_feeds'): (cos, sin) of its
    type, or of the rotary embedding its forward picks for it (GraniteSWA's bases), or every type's by type
    (DeepSeek-V4), or None (no position embeddings)."""
    types = {layer_types[i] for i in range(first, last) if feeds[i] == BY_TYPE}
    if rotary is None:
        by_type = dict.fromkeys(types)
    elif typed(rotary):
        by_type = {kind: rotary(hidden, position_ids, kind) for kind in types}
    else:
        by_type = dict.fromkeys(types, rotary(hidden, position_ids) if types else None)
    if ALL_TYPES in feeds[first:last]:
        every = {kind: rotary(hidden, position_ids, kind) for kind in rotary.layer_types}
    picked = {feeds[i] for i in range(first, last)} - {None, BY_TYPE, ALL_TYPES}
    by_index = {k: rotaries[k](hidden, position_ids) for k in picked}
    given = []
    for i in range(first, last):
        if feeds[i] == BY_TYPE:
            given.append(by_type[layer_types[i]])
        else:
            given.append(every if feeds[i] == ALL_TYPES else by_index.get(feeds[i]))
    return given


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
    return next((n for n in CACHE_ARGUMENTS if n in parameters), "cache")
