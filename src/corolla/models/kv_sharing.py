"""Layers that take an earlier layer's work within the same forward pass: its keys and values (Gemma 3n
and Gemma 4's last layers, Mistral Large 4's `kv_source_layers`), or its sparse-attention selection
(GLM-5 and Mistral Large 4 layers whose `indexer_types` entry is "shared").

Gemma's reusing layers have no key and value projections: each attends with the keys and values of the
last earlier layer of its type (the "store" layer of transformers' `kv_sharing_modes`), handed over in
`shared_kv_states`. A shared-selection layer has no indexer: it attends to the keys that the last earlier
"full" layer picked (`prev_topk_indices`, threaded from layer to layer). Either way a span that holds such
a layer must hold its source too, with that source's cache: a cut between them (a span that starts after
the source but at or before the last layer reading it) is refused by `--blocks`, never chosen by
placement, and never used by routing. Inside a span, a reusing layer's cache pages are its source's
(engine/kv_pool.py's aliases): it stores nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from corolla.errors import InvalidRequest, UnsupportedModel


@dataclass(frozen=True)
class KVSharing:
    sources: Mapping[int, int] = field(default_factory=dict)  # reusing layer -> the layer it reads
    # layer that reuses an earlier layer's sparse-attention selection -> that layer
    selections: Mapping[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, hf: Any, layer_types: tuple[str, ...]) -> KVSharing:
        """The sharing a transformers config declares (none for families without it)."""
        return cls(_kv_sources(hf, layer_types), _selection_sources(hf))

    @property
    def groups(self) -> list[tuple[int, int]]:
        """(source, last layer reading it) per source: the runs of layers a span may not be cut inside."""
        last: dict[int, int] = {}
        for layer, source in [*self.sources.items(), *self.selections.items()]:
            last[source] = max(last.get(source, source), layer)
        return sorted(last.items())

    @property
    def forbidden_cuts(self) -> frozenset[int]:
        """Block indices a span may not start or end at (routing and placement never cut there)."""
        return frozenset(cut for first, last in self.groups for cut in range(first + 1, last + 1))

    def group_cut_by(self, cut: int) -> tuple[int, int] | None:
        """The group that a cut before block `cut` would split (None: the cut is allowed)."""
        return next(((s, e) for s, e in self.groups if s < cut <= e), None)

    def allows(self, cut: int) -> bool:
        return self.group_cut_by(cut) is None

    def check_span(self, start: int, end: int, model_type: str) -> None:
        """Refuse blocks [start, end) if they cut a sharing group (an end at the model's last block, or a
        start at 0, never does)."""
        for cut in (start, end):
            group = self.group_cut_by(cut)
            if group is not None:
                first, last = group
                readers = f"layers {first + 1}-{last} use" if last > first + 1 else f"layer {last} uses"
                shares_kv = first in self.sources.values()
                what = "keys and values" if shares_kv else "sparse-attention selection"
                raise InvalidRequest(
                    f"blocks {start}:{end} cut {model_type}'s layers {first}-{last}: {readers} layer "
                    f"{first}'s {what} in the same pass, so a span holds all of {first}-{last} or none"
                )

    def local_sources(self, start: int, end: int) -> dict[int, int]:
        """Span-local indices of the reusing layers of blocks [start, end) -> their sources'."""
        return _local(self.sources, start, end)

    def local_selections(self, start: int, end: int) -> dict[int, int]:
        """Span-local indices of the shared-selection layers of blocks [start, end) -> their sources'."""
        return _local(self.selections, start, end)


def _local(sources: Mapping[int, int], start: int, end: int) -> dict[int, int]:
    inside = {layer: source for layer, source in sources.items() if start <= layer < end}
    return {layer - start: source - start for layer, source in inside.items()}


def _kv_sources(hf: Any, layer_types: tuple[str, ...]) -> dict[int, int]:
    named = getattr(hf, "kv_source_layers", None)
    if named is not None:  # Mistral Large 4: each layer names the layer whose latent it attends with
        if "reuse_but_indexer" in hf.kv_sharing_modes:
            raise UnsupportedModel(
                f"{hf.model_type}: some layers attend with an earlier layer's latent but rank keys with "
                "an indexer of their own (kv_source_layers), which corolla's cache does not hold"
            )
        return {layer: source for layer, source in enumerate(named) if source != layer}
    if not getattr(hf, "num_kv_shared_layers", 0):
        return {}
    modes = list(hf.kv_sharing_modes)  # Gemma: the last layer of each type before the reusing ones stores
    sources = {}
    for layer, mode in enumerate(modes):
        if mode != "reuse":
            continue
        stores = [j for j in range(layer) if modes[j] == "store" and layer_types[j] == layer_types[layer]]
        if not stores:
            raise UnsupportedModel(f"{hf.model_type}: layer {layer} reuses keys and values no layer stores")
        sources[layer] = stores[-1]
    return sources


def _selection_sources(hf: Any) -> dict[int, int]:
    kinds = list(getattr(hf, "indexer_types", None) or ())
    sources = {}
    for layer, kind in enumerate(kinds):
        if kind != "shared":
            continue
        full = [j for j in range(layer) if kinds[j] == "full"]
        if not full:
            raise UnsupportedModel(
                f"{hf.model_type}: layer {layer} reuses a sparse-attention selection no earlier layer makes"
            )
        sources[layer] = full[-1]
    return sources
