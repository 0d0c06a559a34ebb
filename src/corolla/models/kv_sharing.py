"""Layers that attend with an earlier layer's keys and values instead of their own (Gemma 3n, Gemma 4,
Mistral Large 4's `kv_source_layers`).

In those models the last `num_kv_shared_layers` layers have no key and value projections: each attends
with the keys and values of the last earlier layer of its own type (the "store" layer of
transformers' `kv_sharing_modes`), which hands them over during the same forward pass. So a span that
holds a reusing layer must hold its source too, with that source's cache: a cut between them (a span
that starts after the source but at or before the last layer reading it) is refused by `--blocks`, never
chosen by placement, and never used by routing. Inside a span, the cache pages of a reusing layer are its
source's (engine/kv_pool.py's aliases): it stores nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from corolla.errors import InvalidRequest, UnsupportedModel


@dataclass(frozen=True)
class KVSharing:
    sources: Mapping[int, int] = field(default_factory=dict)  # reusing layer -> the layer it reads
    layer_types: tuple[str, ...] = ()

    @classmethod
    def of(cls, hf: Any, layer_types: tuple[str, ...]) -> KVSharing:
        """The sharing a transformers config declares (none for families without `kv_sharing_modes`)."""
        named = getattr(hf, "kv_source_layers", None)
        if named is not None:  # Mistral Large 4: each layer names the layer whose latent it attends with
            if "reuse_but_indexer" in hf.kv_sharing_modes:
                raise UnsupportedModel(
                    f"{hf.model_type}: some layers attend with an earlier layer's latent but rank keys with "
                    "an indexer of their own (kv_source_layers), which corolla's cache does not hold"
                )
            return cls({layer: source for layer, source in enumerate(named) if source != layer}, layer_types)
        if not getattr(hf, "num_kv_shared_layers", 0):
            return cls()
        modes = list(hf.kv_sharing_modes)
        sources = {}
        for layer, mode in enumerate(modes):
            if mode != "reuse":
                continue
            stores = [j for j in range(layer) if modes[j] == "store" and layer_types[j] == layer_types[layer]]
            if not stores:
                raise UnsupportedModel(
                    f"{hf.model_type}: layer {layer} reuses keys and values that no earlier layer stores"
                )
            sources[layer] = stores[-1]
        return cls(sources, layer_types)

    @property
    def groups(self) -> list[tuple[int, int]]:
        """(source, last layer reading it) per source: the runs of layers a span may not be cut inside."""
        last: dict[int, int] = {}
        for layer, source in self.sources.items():
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
                readers = f"layers {first + 1}-{last} attend" if last > first + 1 else f"layer {last} attends"
                raise InvalidRequest(
                    f"blocks {start}:{end} cut {model_type}'s layers {first}-{last}: {readers} with layer "
                    f"{first}'s keys and values, so a span holds all of {first}-{last} or none of them"
                )

    def local_sources(self, start: int, end: int) -> dict[int, int]:
        """Span-local indices of the reusing layers of blocks [start, end) -> their sources'."""
        inside = {layer: source for layer, source in self.sources.items() if start <= layer < end}
        return {layer - start: source - start for layer, source in inside.items()}
